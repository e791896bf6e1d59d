"""vllmini.model against transformers: config parsing, checkpoint loading, logits through the paged cache.

The reference is a random-weight transformers LlamaForCausalLM (GQA, tied embeddings, Llama-3 rope
scaling) saved as a sharded bfloat16 checkpoint and run in float64. transformers is a test dependency.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from vllmini.attention import AttentionMetadata
from vllmini.errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, InvalidTypeError
from vllmini.kv_cache import PagedKVCache
from vllmini.model import LlamaConfig, LlamaModel, rope_inv_freq
from vllmini.models import hf_parameter_shapes

transformers = pytest.importorskip("transformers")
from llama_cases import LLAMA3_ROPE, hf_config, random_hf_model  # noqa: E402 (needs transformers)


def write_tokenizer(path):
    """A word-level tokenizer over the model's 128 ids: "w5 w17" <-> [5, 17]; ids 0-2 are special."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    del vocab["w0"], vocab["w1"], vocab["w2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A sharded bfloat16 checkpoint directory with a tokenizer and a list of EOS ids."""
    path = tmp_path_factory.mktemp("tiny_llama")
    random_hf_model().to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    write_tokenizer(path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [2, 7]}))
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers on the same (bf16-rounded) weights, in float64."""
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # (len, vocab)


def prefill_meta(lens, block_size, first_block=0):
    """Prefill metadata for fresh sequences of `lens` tokens on consecutive blocks."""
    tables, slots, b = [], [], first_block
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(b, b + nb)))
        slots += [b * block_size + i for i in range(n)]
        b += nb
    width = max(map(len, tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata.build(list(lens), bt, list(lens), slots, len(lens)), tables


# -----------------------------------------------------------------------------
# config


def test_config_both_rope_key_styles_agree():
    new = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE},
    }
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old |= {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE}}
    older = dict(
        old, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}
    )
    a, b, c = (LlamaConfig.from_dict(d) for d in (new, old, older))
    assert a == b == c
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    assert a.head_dim == 16 and a.num_key_value_heads == 2
    plain = LlamaConfig.from_dict({**old, "rope_scaling": None, "rope_theta": 10000.0})
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0
    default = LlamaConfig.from_dict({**new, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None and default.rope_theta == 1e4


def test_config_from_transformers_dict_and_file(checkpoint):
    cfg = LlamaConfig.from_pretrained(checkpoint)
    assert cfg == LlamaConfig.from_dict(hf_config().to_dict())
    assert (cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.rope_scaling["factor"]) == (2, True, 8.0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope"),
        ({"vocab_size": 0}, "vocab_size"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"type 'llama3' lacks \['low_freq_factor', 'high_freq_factor', 'orig",
        ),
        ({"rope_theta": 0.0}, "rope_theta must be > 0"),
        ({"num_attention_heads": 0}, "num_attention_heads must be >= 1, got 0"),
        ({"hidden_size": 2}, "head_dim must be >= 1, got 0"),
        ({"vocab_size": None, "hidden_size": None}, r"config lacks \['vocab_size', 'hidden_size'\]"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ],
)
def test_config_rejects_what_it_cannot_run(change, match):
    d = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    } | change
    with pytest.raises(InvalidArgumentError, match=match):
        LlamaConfig.from_dict(d)


def test_config_types_bools_and_numpy_ints():
    d = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    cfg = LlamaConfig(**d | {"vocab_size": np.int64(128)})
    assert cfg.vocab_size == 128 and type(cfg.vocab_size) is int
    for change, match in (
        ({"num_hidden_layers": True}, "num_hidden_layers must be an int, got bool"),
        ({"hidden_size": 64.0}, "hidden_size must be an int, got float"),
        ({"rope_theta": "1e4"}, "rope_theta must be a number"),
        ({"rope_scaling": "linear"}, "rope_scaling must be a dict"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": None}},
            r"rope_scaling\['factor'\] must be a number",
        ),
    ):
        with pytest.raises(InvalidTypeError, match=match):
            LlamaConfig(**d | change)
    with pytest.raises(InvalidTypeError, match="rope_parameters must be a JSON object"):
        LlamaConfig.from_dict(d | {"rope_parameters": [1]})


def test_llama3_rope_frequencies_match_transformers():
    hf = random_hf_model()
    ours = rope_inv_freq(LlamaConfig.from_dict(hf.config.to_dict()))
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(LlamaConfig.from_dict(hf_config(rope_scaling=None).to_dict()))
    assert not torch.allclose(ours, plain)  # the scaling did something
    torch.testing.assert_close(ours[-1], plain[-1] / 8)  # the lowest frequency is stretched 8x
    assert (ours[:2] > plain[:2] / 8).all()  # higher ones less (here none is left alone: 16 is short)


# -----------------------------------------------------------------------------
# loading


def test_load_sharded_bf16_checkpoint(checkpoint, reference):
    assert len(list(checkpoint.glob("model-*.safetensors"))) > 1  # really sharded
    model = LlamaModel.from_pretrained(checkpoint)
    assert model.dtype == torch.bfloat16  # the stored dtype by default
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    assert model.eos_token_ids == (2, 7)  # a list in generation_config.json
    assert model.tokenizer.encode("w5 w17").ids == [5, 17]
    ref = reference.state_dict()
    _, merged = hf_parameter_shapes(model)  # q/k/v and gate/up are stacked into one projection each
    assert merged["layers.0.self_attn.qkv_proj.weight"] == [
        f"layers.0.self_attn.{x}_proj.weight" for x in "qkv"
    ]
    assert merged["layers.0.mlp.gate_up_proj.weight"] == [
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
    ]

    def hf(name):
        return ref["model." + name if name != "lm_head.weight" else name]

    for name, p in model.state_dict().items():
        want = torch.cat([hf(n) for n in merged[name]]) if name in merged else hf(name)
        torch.testing.assert_close(p.double(), want)


def test_load_in_memory_model_matches_directory(checkpoint, reference):
    from_dir = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32)
    from_obj = LlamaModel.from_pretrained(reference, dtype=torch.float32)
    assert from_obj.device.type == "cpu" and from_obj.eos_token_ids == (2, 7)
    for (n1, p1), (n2, p2) in zip(from_dir.named_parameters(), from_obj.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_untied_single_file_with_old_style_config(tmp_path):
    hf = random_hf_model(seed=1, tie_word_embeddings=False, rope_scaling=None, rope_theta=10000.0)
    hf.save_pretrained(tmp_path)  # one model.safetensors
    assert (tmp_path / "model.safetensors").is_file()
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    model = LlamaModel.from_pretrained(tmp_path)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert model.eos_token_ids == (5,) and model.tokenizer is None
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    meta, _ = prefill_meta([40], 8)
    cache = PagedKVCache(2, 2, 16, 8, num_blocks=6)
    with torch.no_grad():
        got = model(torch.tensor(ids), torch.arange(40), cache, meta, all_logits=True)
    torch.testing.assert_close(got.double(), hf_logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_weights_without_the_model_prefix_load_the_same(tmp_path, checkpoint):
    """load_hf_state_dict takes names with or without the `model.` prefix; from_pretrained does too."""
    from safetensors.torch import save_file

    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    state = {
        k.removeprefix("model."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"
    }
    assert "embed_tokens.weight" in state and not any(k.startswith("model.") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    bare, full = (
        LlamaModel.from_pretrained(tmp_path),
        LlamaModel.from_pretrained(checkpoint, dtype=torch.float32),
    )
    assert bare.dtype == torch.float32  # the stored dtype, read from the unprefixed embedding
    for (n1, p1), (n2, p2) in zip(bare.named_parameters(), full.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_errors(tmp_path, checkpoint):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint directory"):
        LlamaModel.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):  # a CheckpointNotFoundError
        LlamaModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointNotFoundError, match="safetensors"):
        LlamaModel.from_pretrained(tmp_path)
    with pytest.raises(InvalidTypeError, match="directory path or a transformers model"):
        LlamaModel.from_pretrained(42)
    with pytest.raises(InvalidTypeError, match="dtype must be one of"):
        LlamaModel.from_pretrained(checkpoint, dtype=torch.int8)
    hf = random_hf_model(num_hidden_layers=1)
    from safetensors.torch import save_file

    state = {
        k: v.contiguous() for k, v in hf.state_dict().items() if "up_proj" not in k and "lm_head" not in k
    }
    save_file(state, tmp_path / "model.safetensors")
    cfg = json.loads((checkpoint / "config.json").read_text()) | {"num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"{tmp_path}' lacks weights.*up_proj"):
        LlamaModel.from_pretrained(tmp_path)


def _first_shard(root):
    return sorted(root.glob("model-*.safetensors"))[0].name


@pytest.mark.parametrize(
    "name, damage, match",
    [
        ("config.json", lambda b: b"{not json", "Expecting property name"),
        ("config.json", lambda b: b"[1, 2]", "config.json must be a JSON object"),
        ("config.json", lambda b: b.replace(b'"llama"', b'"gpt2"'), "model_type must be one of"),
        ("tokenizer.json", lambda b: b[: len(b) // 2], "EOF"),
        ("generation_config.json", lambda b: b"", "Expecting value"),
        ("model.safetensors.index.json", lambda b: b'{"metadata": {}}', "has no weight_map"),
        (_first_shard, lambda b: b[: len(b) - 100], "incomplete metadata"),
        (_first_shard, lambda b: b[:5], "header too small"),
    ],
)
def test_damaged_checkpoint_file_is_named(checkpoint, tmp_path, name, damage, match):
    """Each damaged file is a CheckpointError (a ValueError) naming the file and what was wrong."""
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    file = root / (name if isinstance(name, str) else name(root))
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match=match) as info:
        LlamaModel.from_pretrained(root)
    assert str(file) in str(info.value)


def test_missing_shard_is_named(checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    (root / _first_shard(root)).unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"no {_first_shard(checkpoint)} in '{root}'"):
        LlamaModel.from_pretrained(root)


# -----------------------------------------------------------------------------
# forward through the paged cache


def test_logits_match_transformers_mixed_batch(checkpoint, reference):
    """Prefill three prompts in one forward, then one forward mixing a new prompt's prefill with three
    decodes, on scattered blocks and a NaN-poisoned cache: every logit as transformers (float64)."""
    model = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32)
    bs = 4
    cache = PagedKVCache(2, 2, 16, bs, num_blocks=40)
    for t in cache.key_caches + cache.value_caches:
        t.fill_(float("nan"))  # unused slots must never be read
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 1, 12, 9)]
    nexts = [int(x) for x in torch.randint(0, 128, (3,), generator=g)]
    # step 1: prefill prompts 0..2, blocks handed out in a scrambled order
    perm = torch.randperm(40, generator=g).tolist()
    tables = [perm[0:2], perm[2:3], perm[3:6]]
    lens = [len(p) for p in prompts[:3]]
    slots = [tables[s][i // bs] * bs + i % bs for s in range(3) for i in range(lens[s])]
    bt = torch.tensor([t + [-1] * (3 - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata.build(lens, bt, lens, slots, 3)
    ids = torch.tensor(sum(prompts[:3], []))
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        all_logits = model(ids, pos, cache, meta, all_logits=True)
        last = model.forward(ids, pos, cache, meta)  # writing the same K/V again changes nothing
    ref = [hf_logits(reference, p) for p in prompts[:3]]
    torch.testing.assert_close(all_logits.double(), torch.cat(ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, all_logits[meta.last_token_indices])
    # step 2: prompt 3 prefills; sequences 0..2 decode one token each (sequence 2 grows into a new block)
    tables.append(perm[6:9])
    tables[2].append(perm[9])
    order = [3, 0, 1, 2]
    new_lens = [9, 8, 2, 13]
    slots = [tables[3][i // bs] * bs + i % bs for i in range(9)]
    slots += [
        tables[s][(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(order[1:], new_lens[1:], strict=True)
    ]
    bt = torch.tensor([tables[s] + [-1] * (4 - len(tables[s])) for s in order], dtype=torch.int32)
    meta = AttentionMetadata.build([9, 1, 1, 1], bt, new_lens, slots, 1)
    assert (meta.num_prefills, meta.num_decodes, meta.num_prefill_tokens) == (1, 3, 9)
    assert meta.max_decode_seq_len == 13  # the decodes' longest, known on the host (the kernels' splits)
    ids = torch.tensor(prompts[3] + nexts)
    pos = torch.tensor(list(range(9)) + [n - 1 for n in new_lens[1:]])
    with torch.no_grad():
        got = model(ids, pos, cache, meta)  # (4, vocab)
    want = [hf_logits(reference, prompts[3])[-1]]
    want += [hf_logits(reference, prompts[s] + [nexts[k]])[-1] for k, s in enumerate(order[1:])]
    torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_close_to_float32(checkpoint, reference, dtype, tol):
    model = LlamaModel.from_pretrained(checkpoint, dtype=dtype)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    meta, _ = prefill_meta([20], 4)
    cache = PagedKVCache(2, 2, 16, 4, num_blocks=5, dtype=dtype)
    with torch.no_grad():
        got = model(torch.tensor(ids), torch.arange(20), cache, meta, all_logits=True)
    assert got.dtype == dtype
    ref = hf_logits(reference, ids)
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{dtype}: relative error {err:.3g}"


def test_forward_rejects_a_cache_of_the_wrong_shape_or_dtype(checkpoint):
    model = LlamaModel.from_pretrained(checkpoint)  # bfloat16
    meta, _ = prefill_meta([3], 4)
    args = (torch.tensor([1, 2, 3]), torch.arange(3))
    with pytest.raises(ValueError, match="kv_cache"):
        model(*args, PagedKVCache(2, 2, 16, 4, num_blocks=2, dtype=torch.float32), meta)
    with pytest.raises(ValueError, match="kv_cache"):
        model(*args, PagedKVCache(1, 2, 16, 4, num_blocks=2, dtype=torch.bfloat16), meta)
    with pytest.raises(ValueError, match="num_tokens"):
        model(torch.tensor([[1, 2, 3]]), torch.arange(3), PagedKVCache(2, 2, 16, 4, num_blocks=2), meta)


def test_forward_checks_slots_and_tables_once_before_writing_anything(checkpoint):
    """Layers skip their own checks, so the model's one check must catch a bad slot or block id."""
    model = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32)
    cache = PagedKVCache(2, 2, 16, 4, num_blocks=2, dtype=torch.float32)
    for c in cache.key_caches + cache.value_caches:
        c.fill_(float("nan"))
    args = (torch.tensor([1, 2, 3]), torch.arange(3))
    meta, _ = prefill_meta([3], 4, first_block=2)  # block 2 of a 2-block pool: slots 8..10
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 8 is out of range"):
        model(*args, cache, meta)
    decode = AttentionMetadata.build([1], torch.tensor([[5]], dtype=torch.int32), [2], [1], 0)
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = 5"):
        model(torch.tensor([7]), torch.tensor([1]), cache, decode)
    assert all(torch.isnan(c).all() for c in cache.key_caches + cache.value_caches)  # nothing written


def test_attention_metadata_checks_its_lists():
    bt = torch.zeros(2, 1, dtype=torch.int32)
    meta = AttentionMetadata.build([3, 1], bt, [3, 5], [0, 1, 2, 9], 1)
    assert meta.last_token_indices.tolist() == [2, 3] and meta.query_start_loc.tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="one new token"):
        AttentionMetadata.build([3, 2], bt, [3, 5], [0, 1, 2, 9, 10], 1)
    with pytest.raises(ValueError, match="slot_mapping has 3 slots"):
        AttentionMetadata.build([3, 1], bt, [3, 5], [0, 1, 2], 1)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3, 1], bt, [2, 5], [0, 1, 2, 9], 1)


def test_rope_frequencies_stay_float32_when_the_model_is_cast():
    cfg = LlamaConfig.from_dict(hf_config().to_dict())
    model = LlamaModel(cfg).to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.inv_freq, rope_inv_freq(cfg), rtol=0, atol=0)


def test_metadata_checked_on_host_then_moved_skips_the_forward_checks(checkpoint, monkeypatch):
    """check_on_host raises what the forward would; once it passed, the forward checks nothing again
    (on a GPU each check is a sync) and gives the same logits."""
    model = LlamaModel.from_pretrained(checkpoint, dtype=torch.float32)
    cache = PagedKVCache(2, 2, 16, 4, num_blocks=4, dtype=torch.float32)
    bad = AttentionMetadata.build([1], torch.tensor([[5]], dtype=torch.int32), [2], [1], 0)
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = 5"):
        bad.check_on_host(4, 4)
    bad = AttentionMetadata.build([2], torch.tensor([[0]], dtype=torch.int32), [2], [1, 1], 1)
    with pytest.raises(ValueError, match="slot 1 more than once"):
        bad.check_on_host(4, 4)
    assert not bad.host_checked
    meta, _ = prefill_meta([3], 4, first_block=1)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    want = model(ids, pos, cache, meta)
    meta.check_on_host(4, 4)
    moved = meta.to("cpu")
    assert moved.host_checked and moved.last_token_indices.tolist() == [2]
    monkeypatch.setattr(AttentionMetadata, "check_on_host", lambda *a, **k: pytest.fail("checked twice"))
    torch.testing.assert_close(model(ids, pos, cache, moved), want, rtol=0, atol=0)
