"""Running one sample through the evaluated model under a method.

Batch size 1, greedy decoding through the decode engine (``sparsekv.engine``: chunked prefill, and on CUDA a decode
step captured as a CUDA graph), with the question fed token by token through the decode steps and each phase timed
separately.
"""

from __future__ import annotations

import math


from .. import models
from ..engine import Engine as DecodeEngine
from ..methods.base import MethodConfig
from ..models import LoadedModel
from .base import EvalError, Sample, encode
from .recall import RecallConfig


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

    def _ids(self, sample: Sample) -> tuple[list[int], list[int]]:
        """Token ids of what is prefilled and of what goes through the decode path one token per step."""
        context, question = sample.context, sample.question
        if self.question_mode == "prefill":
            context, question = context + question, ""
        if not self.chat:
            return encode(self.tokenizer, context, question)
        text = models.chat_prompt(self.tokenizer, context + question)
        cut = text.rfind(question.strip()) if question else len(text)
        if cut < 0:
            raise EvalError("the chat template changed the question's text, so it cannot be fed through the decode "
                            "path; use --question-mode prefill or --chat off")
        # The template's text after the question (end of turn, assistant header) is decoded with it.
        return encode(self.tokenizer, text[:cut], text[cut:], special=False)

    def check_length(self, tokens: int) -> None:
        models.check_context(self.model, tokens, "use smaller --lengths or --max-new-tokens")

    def _decoder(self, tokens: int) -> DecodeEngine:
        """The decode engine for a sample of ``tokens`` tokens in all; a probe (``syncs_host``: the recall and the
        selection probes) syncs with the host in every step, so with it the step is not captured."""
        return DecodeEngine(self.model, self.config, max_context=tokens,
                            cuda_graph=False if getattr(self.config, "syncs_host", False) else None)

    def run(self, sample: Sample):
        """Greedy generation through the decode engine (the question fed through the decode steps); returns the
        engine's ``Generation`` (its ``method`` holds what a probe measured) and the prompt's token count."""
        ctx, question = self._ids(sample)
        total = len(ctx) + len(question) + sample.max_new_tokens
        self.check_length(total)
        eos = self.tokenizer.eos_token_id
        out = self._decoder(total).generate([ctx], sample.max_new_tokens, forced=[question] if question else None,
                                            stop_tokens=() if eos is None else [eos])
        return out, len(ctx) + len(question)

    def generate(self, sample: Sample) -> dict:
        """``run``: the prediction and the run's measurements."""
        out, prompt_tokens = self.run(sample)
        eos = self.tokenizer.eos_token_id
        new = out.tokens[0]
        text = self.tokenizer.decode([t for t in new if t != eos], skip_special_tokens=True)
        return {"prediction": text, "prompt_tokens": prompt_tokens, "new_tokens": len(new),
                **self._measures(out)}

    def perplexity(self, ids: list[int], prefill: int) -> dict:
        """Perplexity of ``ids[prefill:]``: the first ``prefill`` tokens are prefilled, each later token is fed
        through the decode steps, scored by the logits before it."""
        self.check_length(len(ids))
        out = self._decoder(len(ids)).generate([ids[:prefill]], 0, forced=[ids[prefill:]], stop_tokens=())
        ppl = math.exp(out.forced_nll[0] / (len(ids) - prefill))
        return {"score": ppl, "prompt_tokens": len(ids), **self._measures(out)}

    def _measures(self, out) -> dict:
        """Timings, decode statistics and memory of a generation (``sparsekv.engine.Generation``).
        ``kv_held_bytes``: keys and values of the tokens the cache holds at the end; ``kv_resident_bytes``: the bytes
        it has allocated (room for every decode token is reserved after the prompt, a compressed prompt counts
        compressed; ``cuda_peak_bytes`` sees the transient before)."""
        steps, decode_s = out.decode_steps, out.decode_seconds
        measures = {"prefill_s": round(out.prefill_seconds, 4), "decode_s": round(decode_s, 4),
                    "decode_tokens_per_s": round(steps / decode_s, 2) if steps > 0 and decode_s > 0 else None,
                    "kv": out.stats, "kv_held_bytes": out.kv_held_bytes, "kv_resident_bytes": out.kv_device_bytes}
        if out.peak_device_bytes is not None:
            measures["cuda_peak_bytes"] = out.peak_device_bytes
        if isinstance(self.config, RecallConfig):
            measures["recall"] = out.method.recall()
        return measures
