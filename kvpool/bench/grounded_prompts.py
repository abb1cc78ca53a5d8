"""The grounded workload of `kvpool bench speculative`: tasks whose answer copies from the
prompt, the work where prompt lookup (n-gram speculation) pays.

Passages ship inside the package, so the workload needs no download: prose from the held-out
text (`kvpool.bench.heldout_text`) and kvpool's own module docstrings, code from kvpool's own
functions (read from the installed package's own files). Five tasks, in a fixed cycle so any
prefix of the list mixes them: repeat a passage, correct the typos injected into one,
summarise one quoting its key sentences, rename an identifier in a function, and add the
docstring a function was stripped of.

Its control, `chat_tasks`: open-ended chat requests (a story, an explanation, advice, on seeded
topics) with no passage, whose answers have little to copy: what speculation costs where drafts
rarely match. (Random-token prompts are no such control: a model's greedy answer to noise
tends to loop, and prompt lookup finds the loop.)

Invariant: the same seed and limits give the same tasks, passages and typos for the same kvpool
source; the source changes with kvpool's version, so a report carries a fingerprint of the
rendered prompts (`kvpool.bench.speculative`) rather than trusting the seed alone.
"""

from __future__ import annotations

import ast
import functools
import itertools
import random
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.bench.heldout_text import TEXT

PACKAGE = Path(__file__).resolve().parents[1]  # kvpool/, as installed
TASKS = ("repeat", "correct", "summarise", "rename", "docstring")
CODE_TASKS = frozenset({"rename", "docstring"})  # the others take prose
DEFAULT_MAX_PASSAGE_CHARS = 1200
MIN_PASSAGE_CHARS = 300  # shorter passages give answers too short to measure decode on
TYPO_RATE = 0.12  # the share of words of four letters or more given one typo
_INSTRUCTIONS = {
    "repeat": "Repeat the following passage exactly, word for word.",
    "correct": "The following passage contains typos. Rewrite the whole passage with the typos "
               "corrected and nothing else changed.",
    "summarise": "Summarise the following passage in a few sentences, quoting its key "
                 "sentences word for word.",
    "rename": "Rename `{old}` to `{new}` in the following Python code. Reply with the whole "
              "edited code and nothing else.",
    "docstring": "Add a docstring to the following Python function. Reply with the whole "
                 "function and nothing else.",
}
_RENAME_PREFIXES = ("new_", "the_", "our_")
_CHAT_FORMS = ("Write a short story about {}.", "Explain how {} works, for a curious child.",
               "Give me some practical advice about {}.", "Write a poem about {}.",
               "Tell me some interesting facts about {}.")
_TOPICS = ("lighthouses", "bread baking", "volcanoes", "a city library", "honey bees",
           "winter in the mountains", "an old clock", "train journeys", "tides", "gardening",
           "the night sky", "learning to swim", "a lost umbrella", "chess", "rain forests",
           "a village market", "paper kites", "moving house", "bicycles", "the first snow")


@dataclass(frozen=True, slots=True)
class GroundedTask:
    """One request: what to do (`kind`: one of TASKS, or "chat"), with what, and where that
    came from."""

    kind: str
    source: str  # e.g. "heldout_text#3", "kvpool/engine/llm.py:LLM.generate"
    instruction: str
    passage: str  # as the model sees it (typos in, docstring out, code fenced)

    @property
    def messages(self) -> list[dict[str, str]]:
        content = f"{self.instruction}\n\n{self.passage}" if self.passage else self.instruction
        return [{"role": "user", "content": content}]


@dataclass(frozen=True, slots=True)
class _Snippet:
    source: str
    text: str
    node: ast.FunctionDef | ast.AsyncFunctionDef | None = None  # for code: its parse


def grounded_tasks(num_prompts: int, seed: int = 0,
                   max_passage_chars: int = DEFAULT_MAX_PASSAGE_CHARS) -> list[GroundedTask]:
    """`num_prompts` tasks, kinds in TASKS' cycle, passages of at most `max_passage_chars`
    drawn (and typos placed) by `seed`."""
    if max_passage_chars < MIN_PASSAGE_CHARS:
        raise ValueError(f"max_passage_chars must be at least {MIN_PASSAGE_CHARS}, "
                         f"got {max_passage_chars}")
    rng = random.Random(seed)
    prose = itertools.cycle(_shuffled(_prose(max_passage_chars), rng))
    code = itertools.cycle(_shuffled(_functions(max_passage_chars), rng))
    kinds = itertools.islice(itertools.cycle(TASKS), num_prompts)
    return [_make_task(kind, next(code if kind in CODE_TASKS else prose), rng) for kind in kinds]


def chat_tasks(num_prompts: int, seed: int = 0) -> list[GroundedTask]:
    """`num_prompts` open-ended requests (kind "chat", no passage), each a seeded request
    form and topic."""
    rng = random.Random(seed)
    return [GroundedTask("chat", "chat", rng.choice(_CHAT_FORMS).format(rng.choice(_TOPICS)), "")
            for _ in range(num_prompts)]


def render_prompts(tokenizer, tasks: Sequence[GroundedTask]) -> list[list[int]]:
    """Each task as the token ids of its chat prompt, rendered with the model's chat template
    (as `LLM.chat`); ValueError when the model has no tokenizer or no template."""
    from kvpool.engine.chat_prompts import chat_prompts

    prompts = chat_prompts(tokenizer, [task.messages for task in tasks])
    return [prompt["prompt_token_ids"] for prompt in prompts]


def inject_typos(text: str, rng: random.Random, rate: float = TYPO_RATE) -> str:
    """`text` with one typo (two letters swapped, one dropped or one doubled) in about `rate`
    of its words of four letters or more; everything else, whitespace included, unchanged."""
    def typo(match: re.Match[str]) -> str:
        word = match.group()
        if rng.random() >= rate:
            return word
        at = rng.randrange(1, len(word) - 2)  # inner letters: the word stays recognisable
        edit = rng.randrange(3)
        if edit == 0:
            return word[:at] + word[at + 1] + word[at] + word[at + 2:]
        if edit == 1:
            return word[:at] + word[at + 1:]
        return word[:at] + word[at] + word[at:]

    return re.sub(r"[A-Za-z]{4,}", typo, text)


def _make_task(kind: str, snippet: _Snippet, rng: random.Random) -> GroundedTask:
    instruction = _INSTRUCTIONS[kind]
    if kind == "correct":
        return GroundedTask(kind, snippet.source, instruction, inject_typos(snippet.text, rng))
    if kind == "rename":
        old = rng.choice(_renamable_names(snippet.node))
        new = rng.choice(_RENAME_PREFIXES) + old
        return GroundedTask(kind, snippet.source, instruction.format(old=old, new=new),
                            _fenced(snippet.text))
    if kind == "docstring":
        return GroundedTask(kind, snippet.source, instruction,
                            _fenced(_without_docstring(snippet.text, snippet.node)))
    return GroundedTask(kind, snippet.source, instruction, snippet.text)


def _shuffled(snippets: list[_Snippet], rng: random.Random) -> list[_Snippet]:
    snippets = list(snippets)
    rng.shuffle(snippets)
    return snippets


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@functools.cache
def _prose(max_chars: int) -> list[_Snippet]:
    """The held-out text's paragraphs and kvpool's module docstrings (the longest run of
    their first paragraphs that fits), each between MIN_PASSAGE_CHARS and `max_chars`."""
    paragraphs = [_Snippet(f"heldout_text#{index}", " ".join(paragraph.split()))
                  for index, paragraph in enumerate(TEXT.split("\n\n"))]
    docstrings = []
    for path, tree in _package_modules():
        docstring = ast.get_docstring(tree)
        if docstring:
            docstrings.append(_Snippet(path, _leading_paragraphs(docstring, max_chars)))
    return [snippet for snippet in paragraphs + docstrings
            if MIN_PASSAGE_CHARS <= len(snippet.text) <= max_chars]


def _leading_paragraphs(text: str, max_chars: int) -> str:
    kept = ""
    for paragraph in text.split("\n\n"):
        longer = f"{kept}\n\n{paragraph}" if kept else paragraph
        if len(longer) > max_chars:
            break
        kept = longer
    return kept


@functools.cache
def _functions(max_chars: int) -> list[_Snippet]:
    """kvpool's functions and methods that have a docstring and a renamable name, as source
    (dedented), each between MIN_PASSAGE_CHARS and `max_chars` long."""
    snippets = []
    for path, tree in _package_modules():
        lines = (PACKAGE.parent / path).read_text().splitlines()
        for node, qualname in _function_nodes(tree):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            code = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno]))
            if not (MIN_PASSAGE_CHARS <= len(code) <= max_chars):
                continue
            node = ast.parse(code).body[0]  # re-parsed: line numbers within the snippet
            if ast.get_docstring(node) and len(node.body) > 1 and _renamable_names(node):
                snippets.append(_Snippet(f"{path}:{qualname}", code, node))
    return snippets


@functools.cache
def _package_modules() -> list[tuple[str, ast.Module]]:
    """(path relative to the package's parent, parse) of every kvpool module, in path order."""
    return [(path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text()))
            for path in sorted(PACKAGE.rglob("*.py"))]


def _function_nodes(tree: ast.Module):
    """Top-level functions and class methods, with their qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.name
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, f"{node.name}.{item.name}"


def _renamable_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Arguments and local variables used at least twice, of three letters or more, in
    `ast.walk` order (so the draw is seeded, not hash-ordered)."""
    counts: dict[str, int] = {}
    for child in ast.walk(node):
        name = (child.arg if isinstance(child, ast.arg) else
                child.id if isinstance(child, ast.Name) else None)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    bound = {arg.arg for arg in ast.walk(node.args) if isinstance(arg, ast.arg)}
    bound |= {child.id for child in ast.walk(node)
              if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)}
    return [name for name, count in counts.items()
            if name in bound and count >= 2 and len(name) >= 3 and name not in ("self", "cls")]


def _without_docstring(code: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    docstring = node.body[0]
    lines = code.splitlines()
    return "\n".join(lines[:docstring.lineno - 1] + lines[docstring.end_lineno:])
