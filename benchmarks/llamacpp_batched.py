"""Continuous batched greedy decoding through llama-cpp-python's low-level API, for the llama.cpp
baseline's batched mode (`llamacpp_runner.py`, in llama-cpp-python's venv; it imports nothing
from kvpool).

Every request of a run holds its own sequence id in one llama.cpp context while it is live; up
to `n_seq_max` are live at once, and a finished request's id (and KV cells) go to the next
waiting one. Each `llama_decode` call carries one token per decoding sequence, then prompt
chunks of the sequences still prefilling, up to `n_batch` tokens in all; the logits of each
sequence's last token in the batch pick its next token (argmax: greedy). EOS is not special:
each request makes exactly its `max_tokens`.

The KV cache is one stream of `n_ctx_seq` cells per sequence id (`kv_unified` off), so each
sequence attends over its own tokens only. A unified cache (one pool of cells for all
sequences, sized for the run's total tokens) takes less memory, but llama.cpp then computes
every sequence's attention over all the pool's cells, masked: on the 2-core test machine, 4
requests of 200–503 prompt tokens ran 2–3× slower that way (prefill chunks of 512 tokens 4–5 s
against 1.6–2.6 s).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Sequence:
    """One live request: its prompt, how many of its tokens are in the KV cache, its output."""

    index: int  # the request's place in the run
    prompt: list[int]
    max_tokens: int
    num_computed_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    def next_input(self, budget: int) -> list[int]:
        """The tokens to decode next, at most `budget`: a prompt chunk while prefilling, else
        the last token sampled."""
        if self.num_computed_tokens < len(self.prompt):
            return self.prompt[self.num_computed_tokens:self.num_computed_tokens + budget]
        return self.token_ids[-1:]

    @property
    def is_decoding(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt)


class BatchedLlama:
    """One llama.cpp model and context, sized by the caller for the runs it will serve."""

    def __init__(self, model_path: str, n_ctx_seq: int, n_seq_max: int, n_threads: int,
                 n_batch: int = 512) -> None:
        import llama_cpp

        self._lib = llama_cpp  # imported here: this module also imports in kvpool's venv
        llama_cpp.llama_backend_init()
        self._model = llama_cpp.llama_model_load_from_file(
            model_path.encode(), llama_cpp.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = llama_cpp.llama_context_default_params()
        self.n_seq_max = min(n_seq_max, llama_cpp.llama_max_parallel_sequences())
        params.n_seq_max, params.n_batch, params.n_ubatch = self.n_seq_max, n_batch, n_batch
        params.kv_unified = False  # a stream per sequence id (see above) ...
        params.n_ctx = n_ctx_seq * self.n_seq_max  # ... of n_ctx / n_seq_max cells each
        params.n_threads = params.n_threads_batch = n_threads
        # As llama-cpp-python's `Llama` (flash_attn=False): the one-at-a-time mode's kernels,
        # so the two modes' tokens differ by batching alone (auto would pick flash attention).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} tokens")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(
            llama_cpp.llama_model_get_vocab(self._model))
        self._n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)  # one sequence id per token

    def generate(self, requests: list) -> list[list[int]]:
        """Greedy tokens for each (prompt token ids, max_tokens) of `requests`, in order, all
        decoded together from an empty KV cache."""
        self._lib.llama_memory_clear(self._memory, True)
        waiting = deque(_Sequence(index, list(prompt), max_tokens)
                        for index, (prompt, max_tokens) in enumerate(requests))
        free_seq_ids = list(range(self.n_seq_max - 1, -1, -1))  # pop() hands out 0 first
        live: dict[int, _Sequence] = {}
        token_ids: list[list[int]] = [[] for _ in requests]
        while waiting or live:
            while waiting and free_seq_ids:
                live[free_seq_ids.pop()] = waiting.popleft()
            for seq_id in self._step(live):
                sequence = live.pop(seq_id)
                token_ids[sequence.index] = sequence.token_ids
                self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
                free_seq_ids.append(seq_id)
        return token_ids

    def _step(self, live: dict[int, _Sequence]) -> list[int]:
        """One `llama_decode` over the live sequences; the ids of those now finished."""
        outputs = self._fill_batch(live)
        status = self._lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        finished = []
        for row, seq_id in outputs:
            sequence = live[seq_id]
            sequence.token_ids.append(self._argmax(row))
            if len(sequence.token_ids) == sequence.max_tokens:
                finished.append(seq_id)
        return finished

    def _fill_batch(self, live: dict[int, _Sequence]) -> list[tuple[int, int]]:
        """Put the decoding sequences' tokens in the batch, then prompt chunks up to n_batch;
        the (batch row, seq id) of each token whose logits pick a sequence's next token."""
        batch, num_tokens, outputs = self._batch, 0, []
        order = sorted(live, key=lambda seq_id: not live[seq_id].is_decoding)  # decode first
        for seq_id in order:
            sequence = live[seq_id]
            tokens = sequence.next_input(self._n_batch - num_tokens)
            for offset, token in enumerate(tokens):
                row = num_tokens + offset
                batch.token[row], batch.pos[row] = token, sequence.num_computed_tokens + offset
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq_id
                batch.logits[row] = False
            num_tokens += len(tokens)
            sequence.num_computed_tokens += len(tokens)
            if tokens and sequence.is_decoding:  # its last token in the batch ends its prompt
                batch.logits[num_tokens - 1] = True
                outputs.append((num_tokens - 1, seq_id))
            if num_tokens == self._n_batch:
                break
        batch.n_tokens = num_tokens
        return outputs

    def _argmax(self, row: int) -> int:
        import numpy

        logits = self._lib.llama_get_logits_ith(self._ctx, row)
        return int(numpy.ctypeslib.as_array(logits, shape=(self._n_vocab,)).argmax())

    def close(self) -> None:
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._ctx)
        self._lib.llama_model_free(self._model)
