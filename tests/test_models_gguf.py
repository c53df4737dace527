"""GGUF checkpoints as models: a tiny random Llama written with the `gguf` package here (no download), loaded through
`sparsekv.models.load_model`, the CLI and the eval harness; the errors for bad paths and missing packages."""

import json

import numpy as np
import pytest
import torch

from sparsekv import DenseConfig, QuestConfig, apply, models
from sparsekv.cli import main
from sparsekv.eval import EvalSpec, TaskOptions, run_eval

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

LAYERS, DIM, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128


def write_tiny_gguf(path, seed=0, kinds=None):
    """A 2-layer Llama (4 query / 2 KV heads, head_dim 16) with a byte-level BPE vocabulary of the 256 bytes plus
    <|endoftext|> (BOS and EOS), float32 tensors of small random values; ``kinds``: GGUF quantization types of the
    layers' weights by name (e.g. {"attn_q": "Q4_1"}), float32 for those not named."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[i] for i in range(256)] + ["<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(DIM // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def layer_weight(i, name, *shape):
        data, kind = weight(*shape), (kinds or {}).get(name)
        if kind is None:
            writer.add_tensor(f"blk.{i}.{name}.weight", data)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            writer.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    head_dim = DIM // HEADS
    writer.add_tensor("token_embd.weight", weight(len(tokens), DIM))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(DIM, np.float32))
        layer_weight(i, "attn_q", HEADS * head_dim, DIM)
        layer_weight(i, "attn_k", KV_HEADS * head_dim, DIM)
        layer_weight(i, "attn_v", KV_HEADS * head_dim, DIM)
        layer_weight(i, "attn_output", DIM, HEADS * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(DIM, np.float32))
        layer_weight(i, "ffn_gate", FFN, DIM)
        layer_weight(i, "ffn_up", FFN, DIM)
        layer_weight(i, "ffn_down", DIM, FFN)
    writer.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    writer.add_tensor("output.weight", weight(len(tokens), DIM))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_find_gguf_file_and_folder(gguf_file, tmp_path):
    assert models.find_gguf(str(gguf_file)) == (gguf_file.parent, gguf_file.name)
    assert models.find_gguf(str(gguf_file.parent)) == (gguf_file.parent, gguf_file.name)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "other.gguf").write_bytes(b"")
    assert models.find_gguf(str(tmp_path)) is None  # a transformers folder wins over a stray .gguf
    assert models.find_gguf(str(tmp_path / "missing")) is None


def test_find_gguf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        models.find_gguf(str(tmp_path / "absent.gguf"))
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\); pass one of them"):
        models.find_gguf(str(tmp_path))


def test_missing_packages_are_named(gguf_file, monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"needs the package\(s\) gguf; pip install 'sparsekv\[gguf\]'"):
        models.load_model(str(gguf_file), torch.device("cpu"))


def test_load_gguf_and_decode_under_methods(gguf_file):
    loaded = models.load_model(str(gguf_file), torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (LAYERS, KV_HEADS)
    assert tokenizer.decode(tokenizer("hello world").input_ids) == "hello world"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    ids = tokenizer("The grass is green. " * 12, return_tensors="pt")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        plain = model.generate(**ids, **kwargs)
        with apply(model, DenseConfig()):
            dense = model.generate(**ids, **kwargs)
        with apply(model, QuestConfig(token_budget=1024, page_size=16, dense_layers=0)):
            quest = model.generate(**ids, **kwargs)
    assert torch.equal(plain, dense) and torch.equal(plain, quest)  # a budget over the context is dense


def test_a_gguf_is_parsed_once_per_load(tmp_path, monkeypatch):
    """transformers' config, tokenizer and weights, our checks and the file's own blocks share one reader of the file
    and one name map, and the gguf package is as it was after the load (or after a load that fails)."""
    made, maps = [], []
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: made.append(a) or real_reader(*a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or real_map(*a))
    counting_reader, counting_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf_file = write_tiny_gguf(tmp_path / "q4.gguf", kinds={"attn_q": "Q4_1", "ffn_down": "Q8_0"})
    models.load_model(str(gguf_file), torch.device("cpu"), weights="gguf")
    assert len(made) == 1 and len(maps) == len(set(maps)) == 1
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counting_reader, counting_map)
    with pytest.raises(ValueError, match="float or int4 for a model that is not a GGUF file"):
        models.load_model(str(gguf_file.parent / "missing"), torch.device("cpu"), weights="gguf")
    monkeypatch.setattr(models, "check_finite", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        models.load_model(str(gguf_file), torch.device("cpu"))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counting_reader, counting_map)


def test_cli_generate_and_eval_take_a_gguf(gguf_file, tmp_path, capsys):
    assert main(["generate", "--model", str(gguf_file), "--method", "quest", "--budget", "32", "--opt",
                 "dense_layers=0", "--prompt", "The grass is green. " * 8, "--max-new-tokens", "4"]) == 0
    assert "4 new tokens, decode" in capsys.readouterr().err
    out = run_eval(EvalSpec(task="passkey", methods=["dense", "quest"], budgets=[32], lengths=[320], depths=[0.5],
                            limit=1, model=str(gguf_file.parent), out=str(tmp_path / "out"), plots=False,
                            options=TaskOptions(max_new_tokens=2)), log=lambda *_: None, progress=False)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["dense", "quest"]
    assert all(r["model"] == str(gguf_file.parent) and r["prompt_tokens"] > 300 for r in records)


def test_no_progress_hides_the_bar_over_a_gguf_files_tensors(gguf_file, capsys):
    """transformers' bar over a GGUF file's tensors ignores its own switch; ``--no-progress`` hides it too, and the
    bar is transformers' own again after the load."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.utils import logging as hf_logging

    bar = hf_gguf.tqdm
    try:
        assert main(["generate", "--model", str(gguf_file), "--method", "dense", "--prompt", "The grass is green.",
                     "--max-new-tokens", "2", "--no-progress"]) == 0
        err = capsys.readouterr().err
        assert "GGUF tensors" not in err and err.startswith("[dense] prefill of"), err
        assert hf_gguf.tqdm is bar
    finally:
        hf_logging.enable_progress_bar()


def test_find_gguf_ignores_the_extensions_case(gguf_file, tmp_path):
    (tmp_path / "one").mkdir()
    upper = tmp_path / "one" / "M.GGUF"
    upper.write_bytes(gguf_file.read_bytes())
    assert models.find_gguf(str(tmp_path / "one")) == (upper.parent, "M.GGUF")
    assert models.find_gguf(str(upper)) == (upper.parent, "M.GGUF")
    loaded = models.load_model(str(tmp_path / "one"), torch.device("cpu"))  # dtype "auto": float32
    assert loaded.model.dtype == torch.float32 and loaded.model.config.num_hidden_layers == LAYERS
    (tmp_path / "two").mkdir()
    for name in ("a.Gguf", "B.GGUF"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"several GGUF files \(B.GGUF, a.Gguf\)"):
        models.find_gguf(str(tmp_path / "two"))


@pytest.mark.parametrize("keep", [0, 3, 40, 300, 2000, 0.5, -100, -1])
def test_a_truncated_gguf_is_refused_naming_the_file(gguf_file, tmp_path, keep):
    """Cut in the magic, the header, the metadata, the tensor table or the tensor data."""
    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=f"model: {cut} is not a readable GGUF file"):
        models.load_model(str(cut), torch.device("cpu"))


def test_cli_names_a_corrupt_gguf(tmp_path, capsys):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(range(200)))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert f"model: {tmp_path / 'junk.gguf'} is not a readable GGUF file" in capsys.readouterr().err


def _poison(path, tensor, values):
    """Overwrites the first values of a float32 tensor of the GGUF file ``path`` in place."""
    reader = gguf.GGUFReader(path)
    offset = next(int(t.data_offset) for t in reader.tensors if t.name == tensor)
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.asarray(values, np.float32).tobytes())


@pytest.mark.parametrize("tensor, param, values", [
    ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", [np.nan]),
    ("output.weight", "lm_head.weight", [0.1, np.inf]),
    ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", [-np.inf, np.nan]),
])
def test_a_gguf_with_non_finite_weights_is_refused(tmp_path, tensor, param, values):
    path = write_tiny_gguf(tmp_path / "nan.gguf")
    _poison(path, tensor, values)
    with pytest.raises(ValueError, match=rf"model: the GGUF file {path} holds NaN or infinite weights in 1 tensor"
                                         rf"\(s\): {param} \(GGUF tensors: {tensor}\)"):
        models.load_model(str(tmp_path), torch.device("cpu"))


def test_a_model_folder_with_non_finite_weights_is_refused(tmp_path):
    from sparsekv.tiny import byte_tokenizer, tiny_model

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model: '{tmp_path}' holds NaN or infinite weights in 1 tensor\(s\): "
                                         r"model.layers.2.mlp.up_proj.weight; the file is corrupt"):
        models.load_model(str(tmp_path), torch.device("cpu"))
