"""vLLM engine arguments kvpool has no counterpart for: accepted where ignoring them changes
nothing, refused where it would.

A script written for vLLM passes `LLM(model, pipeline_parallel_size=1, trust_remote_code=True,
...)`. Each such argument has one entry in `VLLM_ARGS`: the values at which kvpool behaves as
vLLM does with them (`neutral`; None: every value, for arguments that only tune machinery
kvpool does not have, such as torch.compile), why, and what kvpool supports instead.
`engine_options` sorts a call's keywords:

- an `EngineConfig` option (a section's field, by its flat name) passes through;
- a vLLM name for an option kvpool has under another name is renamed (`RENAMED`);
- a listed argument at a neutral value is dropped, with ONE warning naming all of them;
- a listed argument at another value is a ValueError saying what kvpool supports;
- anything else is a TypeError naming it, with the closest known name.

The CLI registers the entries that have a `flag` type under the same names
(`kvpool.cli.args`), so `kvpool serve` takes `vllm serve`'s flags at the same values. Light (no
torch): the CLI's parser imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.engine.config import OPTION_SECTIONS, SECTIONS, EngineConfig
from kvpool.engine.config.options import flag_of

logger = logging.getLogger(__name__)

_ONE_DEVICE = "kvpool splits a model only by tensor parallelism (tensor_parallel_size)"


@dataclass(frozen=True)
class VLLMArg:
    """One vLLM argument kvpool accepts only for compatibility."""

    name: str
    neutral: tuple[Any, ...] | None  # the values that change nothing; None: every value
    reason: str  # why kvpool behaves as vLLM does when it ignores the argument at those values
    supported: str = ""  # the ValueError for another value: what kvpool supports instead
    flag: type | None = None  # the CLI flag's type (bool: --x / --no-x); None: no flag
    aliases: tuple[str, ...] = ()  # short CLI flags, as vLLM's (-tp)
    names_model: bool = False  # also neutral when the value is the model itself

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    def is_neutral(self, value: Any, model: str | None) -> bool:
        if self.neutral is None:
            return True
        if self.names_model and None not in (value, model) and str(value) == str(model):
            return True
        # True == 1 in Python, but pipeline_parallel_size=True is no size: bools match bools only.
        return any(value == neutral and isinstance(value, bool) == isinstance(neutral, bool)
                   for neutral in self.neutral)


VLLM_ARGS: tuple[VLLMArg, ...] = (
    # Parallelism beyond tensor parallelism (an EngineConfig field): one engine, one process
    # group.
    VLLMArg("pipeline_parallel_size", (1,), _ONE_DEVICE,
            f"{_ONE_DEVICE}; pipeline_parallel_size must be 1", int, ("-pp",)),
    VLLMArg("data_parallel_size", (1,), _ONE_DEVICE,
            f"{_ONE_DEVICE}; data_parallel_size must be 1 (run one kvpool per device behind a "
            "load balancer instead)", int, ("-dp",)),
    VLLMArg("distributed_executor_backend", (None, "uni", "mp"),
            "one device needs no distributed workers",
            "kvpool runs the model in its own process: distributed_executor_backend must be "
            "None, 'uni' or 'mp'", str),
    VLLMArg("enable_expert_parallel", (False,), "kvpool runs dense models: there are no experts",
            "kvpool runs dense models on one device; enable_expert_parallel must be False",
            bool),
    VLLMArg("disable_custom_all_reduce", None, "one device: there is no all-reduce",
            flag=bool),
    # Execution machinery kvpool does not have; none of it changes outputs.
    VLLMArg("compilation_config", None,
            "kvpool does not compile the model (no torch.compile); its CUDA graphs follow "
            "enforce_eager, cudagraph_capture_sizes and max_cudagraph_capture_size",
            flag=str, aliases=("-cc",)),
    VLLMArg("async_scheduling", None, "kvpool schedules each step after the previous one, "
            "which changes speed, not outputs", flag=bool),
    VLLMArg("disable_cascade_attn", None, "kvpool has no cascade attention", flag=bool),
    VLLMArg("disable_sliding_window", (False,),
            "kvpool runs each layer's sliding window as the model defines it",
            "disable_sliding_window=True (full attention with the context capped at the "
            "window) is not supported: kvpool runs the window; max_model_len caps the context",
            bool),
    VLLMArg("prefix_caching_hash_algo", None, "kvpool's prefix cache keys blocks by SHA-256 and "
            "compares their token ids on a hit; the hash changes no output", flag=str),
    # Logging.
    VLLMArg("disable_log_stats", None, "kvpool logs no periodic statistics (engine.stats() "
            "has them)", flag=bool),
    VLLMArg("use_tqdm_on_load", None, "kvpool shows no progress bar while loading", flag=bool),
    VLLMArg("served_model_name", None, "the offline API reports no model name"),
    # Model and tokenizer sources.
    VLLMArg("tokenizer", (None,), "kvpool loads the tokenizer from the model itself",
            "kvpool reads the tokenizer from the model (a GGUF file's vocabulary, or the "
            "directory's tokenizer files); tokenizer must be None or the model", str,
            names_model=True),
    VLLMArg("tokenizer_mode", ("auto", "hf"), "kvpool's tokenizer is transformers' (fast) one",
            "kvpool uses transformers' tokenizer; tokenizer_mode must be 'auto' or 'hf'", str),
    VLLMArg("skip_tokenizer_init", (False,), "kvpool loads the model's tokenizer",
            "kvpool always loads the model's tokenizer when it has one; skip_tokenizer_init "
            "must be False (load_format='dummy' has none: prompts are then token ids)", bool),
    VLLMArg("trust_remote_code", None, "kvpool never runs a checkpoint's code: its own "
            "Llama-family model runs every checkpoint it loads", flag=bool),
    VLLMArg("code_revision", None, "kvpool never runs a checkpoint's code", flag=str),
    VLLMArg("revision", (None, "main"), "kvpool loads a Hub model's main revision",
            "kvpool loads the cached 'main' revision of a Hub model; for another revision, pass "
            "its snapshot directory as the model", str),
    VLLMArg("tokenizer_revision", (None, "main"), "kvpool loads a Hub model's main revision",
            "kvpool loads the tokenizer of the model's cached 'main' revision; "
            "tokenizer_revision must be None or 'main'", str),
    VLLMArg("download_dir", (None,), "kvpool reads Hub models from huggingface_hub's cache",
            "kvpool looks Hub models up in huggingface_hub's cache only: set HF_HUB_CACHE (or "
            "HF_HOME) to that directory instead of download_dir", str),
    VLLMArg("hf_token", None, "kvpool never contacts the Hub (models come from its local "
            "cache), so it sends no token", flag=str),
    VLLMArg("hf_overrides", (None, {}), "the checkpoint's config is used as it is",
            "kvpool reads the checkpoint's config as it is; change a copy of the model "
            "directory's config.json instead of passing hf_overrides"),
    VLLMArg("config_format", ("auto", "hf"), "kvpool reads HF's config.json (or GGUF metadata)",
            "config_format must be 'auto' or 'hf'", str),
    VLLMArg("cpu_offload_gb", (0,), "every weight stays on the device",
            "kvpool keeps every weight on the device; cpu_offload_gb must be 0 (swap_space "
            "gives the KV cache a host tier)", float),
    VLLMArg("runner", ("auto", "generate"), "kvpool generates text: its only runner",
            "kvpool generates text; runner must be 'auto' or 'generate'", str),
    VLLMArg("convert", ("auto", "none"), "kvpool runs the model as it is",
            "kvpool runs generative models as they are; convert must be 'auto' or 'none'", str),
    # Features kvpool does not have: only their "off" value is neutral.
    VLLMArg("max_logprobs", None, "kvpool's offline API caps no logprobs count (the server's "
            "cap is its own setting)"),
    VLLMArg("logprobs_mode", ("raw_logprobs",), "kvpool's logprobs are the raw ones",
            "kvpool returns raw log-probabilities (before temperature and penalties); "
            "logprobs_mode must be 'raw_logprobs'", str),
    VLLMArg("chat_template", (None,), "kvpool chats with the model's own template",
            "kvpool renders chats with the model's own chat template; chat_template must be "
            "None"),
    VLLMArg("logits_processors", (None, []), "no custom logits processors",
            "kvpool has no custom logits processors (SamplingParams has logit_bias, "
            "allowed_token_ids, bad_words and structured_outputs); logits_processors must be "
            "None"),
    VLLMArg("enable_lora", (False,), "no LoRA adapters",
            "kvpool has no LoRA adapters; enable_lora must be False", bool),
    VLLMArg("enable_sleep_mode", (False,), "no sleep mode",
            "kvpool has no sleep mode; enable_sleep_mode must be False", bool),
)
VLLM_ARG_BY_NAME = {arg.name: arg for arg in VLLM_ARGS}
# vLLM's name -> kvpool's, for options kvpool has under another name.
# The long aliases of the engine's flags (`--num-gpu-blocks-override`) are those names.
RENAMED = {alias.removeprefix("--").replace("-", "_"): field.name
           for cls in SECTIONS.values() for field in dataclasses.fields(cls)
           for alias in flag_of(field).aliases if alias.startswith("--")}
ENGINE_CONFIG_FIELDS = frozenset(OPTION_SECTIONS)  # EngineConfig's flat option names


def engine_config(model: str | None, options: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig for `LLM(model, **options)`, vLLM's arguments sorted out first."""
    return EngineConfig(model=model, **engine_options(model, options))


def engine_options(model: str | None, options: Mapping[str, Any],
                   caller: str = "LLM()") -> dict[str, Any]:
    """`options` as EngineConfig fields (see the module docstring for the rules)."""
    known = ENGINE_CONFIG_FIELDS | VLLM_ARG_BY_NAME.keys() | RENAMED.keys()
    for name in options:
        if name not in known:
            match = difflib.get_close_matches(name, sorted(known - {"model"}), n=1)
            hint = f"; did you mean {match[0]!r}?" if match else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
    kept = {name: value for name, value in options.items() if name in ENGINE_CONFIG_FIELDS}
    for vllm_name, name in RENAMED.items():
        if vllm_name in options:
            if name in options:
                raise ValueError(f"{vllm_name} is vLLM's name for {name}: give one of them")
            kept[name] = options[vllm_name]
    ignore_vllm_args(model, {name: value for name, value in options.items()
                             if name in VLLM_ARG_BY_NAME})
    return kept


def ignore_vllm_args(model: str | None, given: Mapping[str, Any]) -> None:
    """Check vLLM-only arguments: ValueError naming every one whose value kvpool cannot honour;
    else one warning naming them all, and why each changes nothing."""
    refused = [f"{name}={value!r}: {VLLM_ARG_BY_NAME[name].supported}"
               for name, value in given.items()
               if not VLLM_ARG_BY_NAME[name].is_neutral(value, model)]
    if refused:
        raise ValueError("unsupported vLLM argument" + ("s" if len(refused) > 1 else "") + ": "
                         + "; ".join(refused))
    if given:
        logger.warning("ignoring vLLM arguments that change nothing in kvpool: %s",
                       ", ".join(f"{name}={value!r} [{VLLM_ARG_BY_NAME[name].reason}]"
                                 for name, value in given.items()))
