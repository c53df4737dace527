"""Loading the evaluated model and running one sample through it under a method.

Batch size 1, greedy decoding in our own loop (not ``generate``), so that the question can be fed token by token
through the decode path and each phase is timed separately.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .. import models
from ..integrations import apply
from ..methods.base import MethodConfig
from .base import EvalError, Sample, encode
from .recall import RecallConfig

@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    name: str

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def load_model(spec: str | None, dtype: str = "auto", device: str = "auto", log=print) -> LoadedModel:
    """``spec``: a local model folder (``from_pretrained``, no downloads), a GGUF file or a folder holding one, or
    ``tiny:<arch>`` (a random-weight model from ``sparsekv.tiny`` with the byte tokenizer).
    None: the project's trained model (``models.DEFAULT_MODEL``)."""
    try:
        if spec is None:
            spec = models.default_model()
            log(f"no --model given: using the project's trained model {spec}")
        model, tokenizer = models.load_model(spec, models.resolve_device(device), models.resolve_dtype(dtype))
    except (ValueError, FileNotFoundError, ImportError) as err:  # ImportError: a missing optional extra
        raise EvalError(f"--model {spec}: {err}") from None
    return LoadedModel(model, tokenizer, spec)


class Engine:
    """Runs samples under one method config.

    question_mode: "decode" feeds the question one token per step through the method (as Quest evaluates the pass
    key); "prefill" prefills it with the context. chat: wrap the prompt in the tokenizer's chat template.
    recall: measure attention recall per layer (see ``recall``).
    """

    def __init__(self, loaded: LoadedModel, config: MethodConfig, question_mode: str = "decode",
                 chat: bool = False, recall: bool = False):
        self.model, self.tokenizer, self.loaded = loaded.model, loaded.tokenizer, loaded
        self.config = RecallConfig(inner=config) if recall else config
        self.question_mode = question_mode
        self.chat = chat
        self.device = next(self.model.parameters()).device

    def _ids(self, sample: Sample) -> tuple[list[int], list[int]]:
        """Token ids of what is prefilled and of what goes through the decode path one token per step."""
        context, question = sample.context, sample.question
        if self.question_mode == "prefill":
            context, question = context + question, ""
        if not self.chat:
            return encode(self.tokenizer, context, question)
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": context + question}],
                                                  tokenize=False, add_generation_prompt=True)
        cut = text.rfind(question.strip()) if question else len(text)
        if cut < 0:
            raise EvalError("the chat template changed the question's text, so it cannot be fed through the decode "
                            "path; use --question-mode prefill or --chat off")
        # The template's text after the question (end of turn, assistant header) is decoded with it.
        return encode(self.tokenizer, text[:cut], text[cut:], special=False)

    def check_length(self, tokens: int) -> None:
        limit = self.loaded.max_positions
        if limit is not None and tokens > limit:
            raise EvalError(f"context of {tokens} tokens (prompt plus new tokens) exceeds the model's maximum of "
                            f"{limit} (max_position_embeddings); use smaller --lengths or --max-new-tokens")

    def _step(self, ids: list[int], cache):
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float(), out.past_key_values

    @torch.inference_mode()
    def generate(self, sample: Sample) -> dict:
        """Greedy generation; returns the prediction and the run's measurements."""
        ctx, question = self._ids(sample)
        self.check_length(len(ctx) + len(question) + sample.max_new_tokens)
        eos = self.tokenizer.eos_token_id
        self._reset_peak()
        with apply(self.model, self.config) as session:
            t0 = time.perf_counter()
            logits, cache = self._step(ctx, None)
            models.synchronize(self.device)
            t1 = time.perf_counter()
            after_prompt = session.cache.resident_bytes()
            for tok in question:
                logits, cache = self._step([tok], cache)
            new: list[int] = []
            while len(new) < sample.max_new_tokens:
                tok = int(logits.argmax())
                new.append(tok)
                if tok == eos or len(new) == sample.max_new_tokens:
                    break
                logits, cache = self._step([tok], cache)
            models.synchronize(self.device)
            t2 = time.perf_counter()
        text = self.tokenizer.decode([t for t in new if t != eos], skip_special_tokens=True)
        steps = len(question) + len(new) - 1
        return {"prediction": text, "prompt_tokens": len(ctx) + len(question),
                "new_tokens": len(new), **self._measures(session, t1 - t0, t2 - t1, steps, after_prompt)}

    @torch.inference_mode()
    def perplexity(self, ids: list[int], prefill: int) -> dict:
        """Perplexity of ``ids[prefill:]``: the first ``prefill`` tokens are prefilled, each later token is fed
        through the decode path to predict the next."""
        self.check_length(len(ids))
        self._reset_peak()
        nll = 0.0
        with apply(self.model, self.config) as session:
            t0 = time.perf_counter()
            logits, cache = self._step(ids[:prefill], None)
            models.synchronize(self.device)
            t1 = time.perf_counter()
            after_prompt = session.cache.resident_bytes()
            for i in range(prefill, len(ids)):
                nll -= float(torch.log_softmax(logits, -1)[ids[i]])
                if i + 1 < len(ids):
                    logits, cache = self._step([ids[i]], cache)
            t2 = time.perf_counter()
        ppl = math.exp(nll / (len(ids) - prefill))
        return {"score": ppl, "prompt_tokens": len(ids),
                **self._measures(session, t1 - t0, t2 - t1, len(ids) - prefill - 1, after_prompt)}

    def _measures(self, session, prefill_s: float, decode_s: float, steps: int, after_prompt: int) -> dict:
        """Timings, decode statistics and memory. ``kv_resident_bytes``: the paged cache's resident bytes after the
        prompt pass or at the end, whichever is larger (a prompt compressed within its own pass counts
        compressed; ``cuda_peak_bytes`` sees that transient too)."""
        out = {"prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
               "decode_tokens_per_s": round(steps / decode_s, 2) if steps > 0 and decode_s > 0 else None,
               "kv": session.stats.summary(),
               "kv_resident_bytes": max(after_prompt, session.cache.resident_bytes())}
        if self.device.type == "cuda":
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if isinstance(self.config, RecallConfig):
            out["recall"] = session.method.recall()
        return out

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
