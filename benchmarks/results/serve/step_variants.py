"""What the serving runner's step variants cost (``serve.runner.Runner``), Llama-3-8B shape (random weights, bf16,
vocabulary 128256): ROWS rows of 512-token prompts decoded by METHOD at budget 2048, the captured step timed (CUDA
events, median of 30 steps, the host's read of the step's tokens included) as it is (no row asking for anything),
with every row asking for the top 5 log-probabilities, and with every row's sampling adjusting its logits
(presence and frequency penalties, a logit bias), in turn, twice each; and ``engine.token_logprobs`` and
``engine.penalize`` alone over ROWS rows of logits (a CUDA graph each, median of 100 replays).

    PYTHONPATH=$PWD python benchmarks/results/serve/step_variants.py METHOD ROWS OUT.json
"""
import json
import sys

import torch

from sparsekv.bench.common import Timer, fill_rows, shape_model
from sparsekv.engine import Sampling, penalize, token_logprobs
from sparsekv.eval.runner import method_runs
from sparsekv.serve.runner import TOP_LOGPROBS, Runner

method, rows, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dev = torch.device("cuda")
prompt_len, max_context = 512, 4096
model = shape_model("llama3-8b", dev, torch.bfloat16, max_context)
config = method_runs([method], [2048])[0].config
runner = Runner(model, config, max_batch=rows, max_context=max_context, prefill_chunk=4096, cuda_graph=None,
                compile=False)
fill_rows(runner, rows, prompt_len, 1024)
vocab = model.config.vocab_size
sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.5, logit_bias={13: 5.0, 2000: -100.0})
penalties = sampling.penalties(rows, vocab, dev)
runner.repetition[:rows], runner.presence[:rows], runner.frequency[:rows], runner.bias[:rows] = penalties
timer = Timer(dev, reps=30, warmup=3)  # the warm-up runs each variant eagerly, then captures it
res = {"method": method, "rows": rows, "device": torch.cuda.get_device_name(dev), "steps_ms": []}
for variant in ("plain", "logprobs", "penalties") * 2:
    runner.logprobs = [5 if variant == "logprobs" else None] * rows
    runner.adjusted = [variant == "penalties"] * rows
    ms = timer.eager(runner.decode)
    res["steps_ms"].append({"variant": variant, "ms": ms})
    print(f"{method} rows {rows} {variant}: step {ms:.3f} ms", flush=True)
logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
token = logits.argmax(-1)
res["token_logprobs_ms"] = Timer(dev, reps=100).graph(lambda: token_logprobs(logits, token, TOP_LOGPROBS))
counts, prompt = torch.zeros(rows, vocab, device=dev), torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
res["penalize_ms"] = Timer(dev, reps=100).graph(lambda: penalize(logits, counts, prompt, *penalties))
for name in ("token_logprobs", "penalize"):
    print(f"{name} over {rows} rows: {res[name + '_ms'] * 1e3:.1f} us", flush=True)
json.dump(res, open(out, "w"), indent=1)
