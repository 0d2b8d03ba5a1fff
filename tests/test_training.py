"""Heads training: teacher alignment, drafting vocabulary, loss going down, exact resume.

Everything runs on a tiny random Llama (hidden 32, vocabulary 64) and a dozen short
sequences, so each test takes a second or two on a CPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from entmtp_hf.heads import DraftHeads
from entmtp_hf.heads.eagle import eagle3_feature_layers
from entmtp_hf.tools.cli import build_parser
from entmtp_hf.tools.training import (
    SPLIT_TRAIN,
    SPLIT_VAL,
    TeacherCache,
    TokenSeq,
    TrainConfig,
    coverage,
    cut,
    draft_vocabulary,
    epoch_batches,
    extract_hidden,
    head_targets,
    open_cache,
    supervised_tokens,
    teacher_logprobs,
    train_heads,
)

V, H = 64, 32


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    m = tiny_llama()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(6.0)  # sharp, position-dependent distributions
    return m


def make_cache(root, model, n: int = 14, seed: int = 0, feature_layers=()) -> TeacherCache:
    """Random sequences of 12-30 tokens; every fourth one held out; some with a prompt."""
    rng = np.random.default_rng(seed)
    seqs = [
        TokenSeq(
            "gsm8k",
            tuple(int(x) for x in rng.integers(0, V, rng.integers(12, 31))),
            start=int(3 * (k % 2)),
            split=SPLIT_VAL if k % 4 == 3 else SPLIT_TRAIN,
        )
        for k in range(n)
    ]
    cache = TeacherCache.create(root, seqs, H, {"sources": {}}, feature_layers=feature_layers)
    extract_hidden(model, cache, batch_tokens=64, log=lambda m: None)
    return cache


def config(tmp_path, **kw) -> TrainConfig:
    args = dict(
        family="hydra",
        arch="mlp",
        num_heads=3,
        draft_vocab_size=48,
        work_dir=str(tmp_path),
        batch_tokens=64,
        max_seq_len=32,
        epochs=4,
        lr=3e-2,
        warmup_steps=2,
        save_every=1000,
        eval_every=0,
        tau_prompts=0,
        save_dtype="float32",
    )
    args.update(kw)
    return TrainConfig(**args)


# ----------------------------------------------------------------------------- vocabulary
def test_draft_vocabulary_is_most_frequent_first_with_id_ties():
    tokens = np.array([5, 5, 5, 2, 2, 9, 9, 7])
    assert draft_vocabulary(tokens, 3, 16).tolist() == [5, 2, 9]  # 2 and 9 tie: smaller id first
    # fewer distinct ids than K: padded with the smallest unused ids
    assert draft_vocabulary(tokens, 6, 16).tolist() == [5, 2, 9, 7, 0, 1]
    assert draft_vocabulary(tokens, 99, 16).numel() == 16
    vocab = draft_vocabulary(tokens, 2, 16)
    assert coverage(vocab, tokens) == pytest.approx(5 / 8)
    assert torch.equal(draft_vocabulary(tokens[::-1].copy(), 3, 16), vocab.new_tensor([5, 2, 9]))  # order-free


def test_cut_keeps_supervised_rows():
    seq = TokenSeq("distill", tuple(range(10)), start=6)
    pieces = cut(seq, 4)
    assert [p.ids for p in pieces] == [(4, 5, 6, 7), (8, 9)]
    assert [p.start for p in pieces] == [2, 0]  # the first piece (rows 0-3 < start) is dropped


# ----------------------------------------------------------------------------- teacher
def test_teacher_targets_align_with_a_direct_computation(tmp_path, model):
    """Head i at row t <-> the base distribution at position t+i+1 (its prediction of t+i+2)."""
    cache = make_cache(tmp_path / "data", model, n=4)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40]
    w = model.get_output_embeddings().weight[vocab]
    ks = [0, 1, 2]
    b = cache.batch(ks)
    teacher = teacher_logprobs(b["hidden"], w)
    with torch.no_grad():
        for r, k in enumerate(ks):
            ids = torch.from_numpy(cache.ids(k).astype(np.int64))
            start = int(cache.seqs[k, 2])
            for i in range(3):
                target, rows = head_targets(teacher, b["sup"], b["valid"], i)
                n = len(ids)
                for t in range(n - i - 1):
                    # the base model's logits after reading x_0..x_{t+i+1}: its prediction of x_{t+i+2}
                    logits = model(ids[None, : t + i + 2]).logits[0, -1]
                    want = torch.log_softmax(logits[vocab], -1)
                    assert torch.allclose(target[r, t], want, atol=2e-2), (k, i, t)
                    assert int(cache.greedy[cache.seqs[k, 0] + t + i + 1]) == int(logits.argmax())
                    assert bool(rows[r, t]) == (t >= start)
                assert not rows[r, n - i - 1 :].any()  # no target beyond the sequence (padding)


def test_bfloat16_teacher_is_close_to_float32_and_resumes_in_its_precision(tmp_path, model):
    fp32 = make_cache(tmp_path / "fp32", model, n=6)
    seqs = [TokenSeq("gsm8k", tuple(int(x) for x in fp32.ids(k))) for k in range(6)]
    bf16 = TeacherCache.create(tmp_path / "bf16", seqs, H, {"sources": {}})
    calls = []
    extract_hidden(model, bf16, batch_tokens=64, log=calls.append, dtype="bfloat16")
    assert json.loads((bf16.root / "extract.json").read_text())["dtype"] == "bfloat16"
    a, b = np.asarray(fp32.hidden, np.float32), np.asarray(bf16.hidden, np.float32)
    assert not np.array_equal(a, b)  # really ran in another precision
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    # a resumed extraction keeps the recorded precision even when asked for another one
    progress = json.loads((bf16.root / "extract.json").read_text())
    redo = progress["done"].pop()
    (bf16.root / "extract.json").write_text(json.dumps(progress))
    bf16.hidden[:] = 0
    extract_hidden(model, bf16, batch_tokens=64, log=calls.append, dtype="float32")
    ks = bf16.extraction_batches()[0][redo]
    for k in ks:
        o, n = bf16.seqs[k, :2]
        assert np.allclose(np.asarray(bf16.hidden[o : o + n], np.float32), b[o : o + n], atol=1e-3)


def test_a_grown_cache_copies_the_rows_it_shares_and_computes_the_rest(tmp_path, model):
    old = make_cache(tmp_path / "old" / "data", model, n=6)
    rng = np.random.default_rng(7)
    shared = [
        TokenSeq("gsm8k", tuple(int(x) for x in old.ids(k)), int(old.seqs[k, 2]), int(old.seqs[k, 3])) for k in range(6)
    ]
    added = [TokenSeq("distill", tuple(int(x) for x in rng.integers(0, V, 20 + k))) for k in range(4)]
    seqs = added[:2] + shared + added[2:]  # another order than the old cache's
    grown = TeacherCache.create(tmp_path / "grown", seqs, H, {"sources": {}})
    logs = []
    extract_hidden(model, grown, batch_tokens=64, log=logs.append, reuse=open_cache(tmp_path / "old"))
    assert sorted(grown.copied) == list(range(2, 8)) and grown.complete and grown.ready.all()
    assert any("6 of 10 sequences" in m for m in logs)
    computed = {k for b in grown.extraction_batches()[0] for k in b}
    assert computed == {0, 1, 8, 9}  # only the new sequences ran through the model
    fresh = TeacherCache.create(tmp_path / "fresh", seqs, H, {"sources": {}})
    extract_hidden(model, fresh, batch_tokens=64, log=lambda m: None)
    for k in range(len(seqs)):
        o, n = grown.seqs[k, :2]
        if 2 <= k < 8:  # copied bit for bit
            so, _ = old.seqs[k - 2, :2]
            assert np.array_equal(grown.hidden[o : o + n], old.hidden[so : so + n])
        assert np.allclose(
            np.asarray(grown.hidden[o : o + n], np.float32), np.asarray(fresh.hidden[o : o + n], np.float32), atol=1e-3
        )
        assert np.array_equal(grown.greedy[o : o + n], fresh.greedy[o : o + n])
    # a resumed extraction keeps the copies and the layout
    extract_hidden(model, grown, batch_tokens=64, log=lambda m: None)
    assert sorted(grown.copied) == list(range(2, 8))


def test_reuse_refuses_another_precision_or_folder_without_a_cache(tmp_path, model):
    old = make_cache(tmp_path / "old", model, n=3)
    seqs = [TokenSeq("gsm8k", tuple(int(x) for x in old.ids(k))) for k in range(3)]
    new = TeacherCache.create(tmp_path / "new", seqs, H, {"sources": {}})
    with pytest.raises(ValueError, match="old.*extracted in float32"):
        extract_hidden(model, new, batch_tokens=64, log=lambda m: None, dtype="bfloat16", reuse=old)
    assert not (new.root / "extract.json").exists()  # nothing half-written
    with pytest.raises(FileNotFoundError, match="no teacher cache"):
        open_cache(tmp_path / "nowhere")
    torch.manual_seed(1)
    other = LlamaForCausalLM(model.config).eval()  # same shapes, other weights
    with pytest.raises(ValueError, match="old.*another base model"):
        extract_hidden(other, new, batch_tokens=64, log=lambda m: None, reuse=old)
    assert not (new.root / "extract.json").exists()


# ----------------------------------------------------------------------------- training
def test_a_cache_keeps_the_fused_states_a_drafter_reads(tmp_path, model):
    """EAGLE-3 drafters read three base states: the cache keeps them beside the last one, each row
    equal to the model's own hidden state there, and a batch concatenates them in the heads' order."""
    layers = eagle3_feature_layers(model.config.num_hidden_layers)
    cache = make_cache(tmp_path / "fused", model, n=4, feature_layers=layers)
    assert TeacherCache(cache.root).feature_layers == tuple(layers)
    b = cache.batch([0, 1], [layers[1], -1, layers[0]])
    for r, k in enumerate([0, 1]):
        ids = torch.from_numpy(cache.ids(k).astype(np.int64))[None]
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
        n = ids.shape[1]
        want = torch.cat([states[layers[1]][0], states[-1][0], states[layers[0]][0]], dim=-1)
        assert torch.allclose(b["features"][r, :n], want, atol=2e-3 * want.abs().max().item())
        assert torch.equal(b["features"][r, :n, H : 2 * H], b["hidden"][r, :n])
    assert "features" not in cache.batch([0])  # heads reading the last state alone get no copy of it
    plain = make_cache(tmp_path / "plain", model, n=4)
    with pytest.raises(ValueError, match=f"{plain.root}.*reads? base hidden states \\[{layers[0]}"):
        plain.batch([0], layers)
    grown = TeacherCache.create(
        tmp_path / "grown",
        [TokenSeq("gsm8k", tuple(int(x) for x in plain.ids(0)))],
        H,
        {"sources": {}},
        feature_layers=layers,
    )
    with pytest.raises(ValueError, match=f"{plain.root}: keeps hidden states \\[\\]"):
        extract_hidden(model, grown, batch_tokens=64, log=lambda m: None, reuse=plain)
    with pytest.raises(ValueError, match="distinct hidden-state indices"):
        TeacherCache.create(tmp_path / "bad", [], H, {}, feature_layers=[1, 1])
    # a cache that keeps fewer layers (an MTP or EAGLE-1 drafter's) copies its rows from one that keeps more
    fused = open_cache(cache.root)
    seqs = [TokenSeq("gsm8k", tuple(int(x) for x in fused.ids(k))) for k in (2, 0)]
    for keep in ([], [layers[2], layers[0]]):
        fewer = TeacherCache.create(tmp_path / f"fewer{len(keep)}", seqs, H, {"sources": {}}, feature_layers=keep)
        extract_hidden(model, fewer, batch_tokens=64, log=lambda m: None, reuse=fused)
        assert sorted(fewer.copied) == [0, 1] and fewer.complete
        for k, src in enumerate((2, 0)):
            (o, n), (so, _) = fewer.seqs[k, :2], fused.seqs[src, :2]
            assert np.array_equal(fewer.hidden[o : o + n], fused.hidden[so : so + n])
            for j, layer in enumerate(keep):
                want = fused.features[so : so + n, layers.index(layer)]
                assert np.array_equal(fewer.features[o : o + n, j], want)


@pytest.mark.parametrize(
    "family,arch",
    [("hydra", "mlp"), ("hydra", "prefix-mlp"), ("medusa", "mlp"), ("eagle", "eagle"), ("eagle", "eagle3")],
)
def test_a_few_steps_reduce_the_loss(tmp_path, model, family, arch):
    layers = eagle3_feature_layers(model.config.num_hidden_layers) if arch == "eagle3" else ()
    cache = make_cache(tmp_path / "data", model, feature_layers=layers)
    cfg = config(tmp_path, family=family, arch=arch)
    batches = len(epoch_batches(cache.split(SPLIT_TRAIN), cache.seqs[:, 1], cfg.batch_tokens, cfg.seed, 0))
    summary = train_heads(cfg, model, cache=cache, measure=False)
    curve = summary["loss_curve"]
    assert len(curve) == summary["total_steps"] >= 3 * batches
    assert np.mean(curve[-batches:]) < 0.8 * np.mean(curve[:batches])
    heads = DraftHeads.from_pretrained(tmp_path / cfg.run_name / "final")
    # EAGLE-3 carries its own LM head (as engines load it), the other archs share the base one
    assert heads.family == family and heads.config.use_base_lm_head == (arch != "eagle3")
    assert heads.draft_vocab.numel() == 48
    assert len(summary["validation"]["top1"]) == 3
    card = heads.card  # what the run measured is kept with the heads, and their README says it
    assert card.validation_top1 == tuple(round(x, 4) for x in summary["validation"]["top1"])
    assert card.hardware and "Distillation from the frozen base model" in card.recipe and card.training_data
    readme = (tmp_path / cfg.run_name / "final" / "README.md").read_text()
    assert "## Validation" in readme and f"| 0 | t+2 | {round(card.validation_top1[0], 3):.4g} |" in readme


def test_an_eagle3_drafter_starts_from_the_base_rows_and_exports_as_eagle3(tmp_path, model):
    """Its own LM head starts as the base LM head's rows of its drafting vocabulary (so the warm start
    is the logit lens it says), and what training wrote is an EAGLE-3 checkpoint engines load."""
    from entmtp_hf.tools.export_heads import export_heads
    from entmtp_hf.tools.training.loop import _initial_heads

    layers = eagle3_feature_layers(model.config.num_hidden_layers)
    cache = make_cache(tmp_path / "data", model, feature_layers=layers)
    cfg = config(tmp_path, family="eagle", arch="eagle3", run_name="e3")
    heads, vocab = _initial_heads(cfg, model, cache)
    assert torch.equal(heads.lm_head.weight, model.get_output_embeddings().weight[vocab])
    train_heads(cfg, model, cache=cache, measure=False, stop_after=2)
    trained = DraftHeads.from_pretrained(tmp_path / "e3" / "final")
    assert (export_heads(trained, "eagle3", tmp_path / "export") / "config.json").is_file()


def test_resume_matches_an_uninterrupted_run(tmp_path, model):
    cache = make_cache(tmp_path / "data", model)
    kw = dict(arch="prefix-mlp", epochs=2, save_dtype="float16")
    full = train_heads(config(tmp_path, run_name="full", **kw), model, cache=cache, measure=False)
    part = config(tmp_path, run_name="part", **kw)
    train_heads(part, model, cache=cache, measure=False, stop_after=3)  # stops mid-epoch
    train_heads(part, model, cache=cache, measure=False, stop_after=2, resume=True)  # crosses the epoch end?
    rest = train_heads(part, model, cache=cache, measure=False, resume=True)
    assert rest["steps"] == full["steps"]
    assert full["loss_curve"][-len(rest["loss_curve"]) :] == rest["loss_curve"]
    a = DraftHeads.from_pretrained(tmp_path / "full" / "final").state_dict()
    b = DraftHeads.from_pretrained(tmp_path / "part" / "final").state_dict()
    stored = load_file(tmp_path / "full" / "final" / "model.safetensors")
    assert next(iter(v for v in stored.values() if v.is_floating_point())).dtype == torch.float16
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_tau_check_needs_heads_as_deep_as_its_tree():
    # refused before any training, not after it (the check decodes with mc_sim_7b_63, depth 4)
    with pytest.raises(ValueError, match="mc_sim_7b_63, a tree of depth 4, deeper than num_heads 3"):
        TrainConfig(num_heads=3, tau_prompts=2)
    assert TrainConfig(num_heads=3, tau_prompts=0).num_heads == 3
    assert TrainConfig(num_heads=4, tau_prompts=2).tau_prompts == 2


def test_the_eagle_arch_implies_its_family():
    assert TrainConfig(arch="eagle").family == "eagle" and TrainConfig().family == "hydra"


def test_the_data_sources_build(tmp_path, demo_copy):
    """Every real-text source reads through (they import the datasets module at call time)."""
    from transformers import AutoTokenizer

    from entmtp_hf.tools.training import build_sequences

    tokenizer = AutoTokenizer.from_pretrained(demo_copy())
    seqs, manifest = build_sequences(
        tokenizer, TrainConfig(sources=("gsm8k",), max_tokens=4000, work_dir=str(tmp_path)), log=lambda m: None
    )
    assert seqs and manifest["sources"]["gsm8k"]["train"]["tokens"] > 0


def test_a_train_offset_trains_on_the_next_documents_and_validates_on_the_same(tmp_path):
    """A further round (``train_offset`` = the earlier round's ``max_tokens``) starts where that round's train
    documents ended; its validation documents are that round's."""
    from entmtp_hf.tools.training import build_sequences

    rows = [
        {"source": "math", "prompt_id": f"q{i}", "prompt_ids": [1, 2, 3], "response_ids": [4 + i % 9] * (20 + i % 7)}
        for i in range(300)
    ]
    (tmp_path / "distill-math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def docs(split, **kw):
        cfg = TrainConfig(sources=("distill",), distill_dir=str(tmp_path), distill_share=1.0, val_fraction=0.2, **kw)
        return [s.ids for s in build_sequences(None, cfg, log=lambda m: None)[0] if s.split == split]

    first, second = docs(SPLIT_TRAIN, max_tokens=1500), docs(SPLIT_TRAIN, max_tokens=1500, train_offset=1500)
    assert first and second and docs(SPLIT_TRAIN, max_tokens=6000)[: len(first) + len(second)] == first + second
    assert docs(SPLIT_VAL, max_tokens=1500) == docs(SPLIT_VAL, max_tokens=1500, train_offset=1500)
    with pytest.raises(ValueError, match="train_offset must be >= 0"):
        TrainConfig(train_offset=-1)


def test_a_teacher_cache_of_another_round_is_refused_and_other_settings_are_said(tmp_path):
    from entmtp_hf.errors import FileFormatError
    from entmtp_hf.tools.training.teacher import _check_built_with

    manifest, said = {"built_with": {"max_tokens": 900, "train_offset": 0, "sources": ["distill"]}}, []
    _check_built_with(tmp_path, manifest, TrainConfig(max_tokens=900, sources=("distill",)), said.append)
    assert said == []
    _check_built_with(tmp_path, manifest, TrainConfig(max_tokens=600, sources=("distill",)), said.append)
    assert said == [f"the teacher cache in {tmp_path} was built with max_tokens=900: training on its documents"]
    for built in (manifest, {"built_with": {"max_tokens": 900}}):  # older caches name no offset: theirs was 0
        with pytest.raises(FileFormatError, match="built for train_offset=0, this run asks for 900"):
            _check_built_with(tmp_path, built, TrainConfig(max_tokens=900, train_offset=900), said.append)


def test_cli_registers_train_heads():
    args = build_parser().parse_args(["train-heads", "--family", "medusa", "--max-steps", "5", "--resume"])
    assert args.func.__name__ == "_train_command" and args.family == "medusa" and args.resume


def test_init_from_continues_given_heads_and_keeps_their_vocabulary(tmp_path, model):
    cache = make_cache(tmp_path / "data", model)
    first = train_heads(config(tmp_path, run_name="a", epochs=1), model, cache=cache, measure=False)
    src = tmp_path / "a" / "final"
    second = train_heads(
        config(tmp_path, run_name="b", epochs=1, lr=1e-3, init_from=str(src)), model, cache=cache, measure=False
    )
    assert second["loss_curve"][0] < first["loss_curve"][0]  # starts from the trained heads
    a, b = DraftHeads.from_pretrained(src), DraftHeads.from_pretrained(tmp_path / "b" / "final")
    assert torch.equal(a.draft_vocab, b.draft_vocab)
    with pytest.raises(ValueError, match="init-from"):
        train_heads(
            config(tmp_path, run_name="c", family="medusa", init_from=str(src)), model, cache=cache, measure=False
        )


def test_init_from_fewer_heads_extends_them_with_copies_of_the_last(tmp_path, model):
    from entmtp_hf.tools.training.loop import init_heads_from

    cache = make_cache(tmp_path / "data", model)
    train_heads(config(tmp_path, run_name="a", epochs=1, arch="prefix-mlp"), model, cache=cache, measure=False)
    src = tmp_path / "a" / "final"
    given = DraftHeads.from_pretrained(src)
    got = init_heads_from(config(tmp_path, num_heads=5, arch="prefix-mlp", init_from=str(src)), model)
    assert got.num_heads == 5 and torch.equal(got.draft_vocab, given.draft_vocab)
    mine, theirs = got.state_dict(), given.state_dict()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key  # the given heads and the prefix layer, unchanged
    last, new = theirs["mlps.2.0.linear.weight"], mine["mlps.4.0.linear.weight"]  # reads 4H -> 6H features
    assert torch.equal(new[:, :H], last[:, :H]) and torch.equal(new[:, 3 * H :], last[:, H:])
    assert not new[:, H : 3 * H].any() and torch.equal(mine["mlps.4.0.linear.bias"], theirs["mlps.2.0.linear.bias"])
    # the extended heads train: a run from them finishes and keeps five heads
    train_heads(
        config(tmp_path, run_name="b", max_steps=2, num_heads=5, arch="prefix-mlp", init_from=str(src)),
        model,
        cache=cache,
        measure=False,
    )
    assert DraftHeads.from_pretrained(tmp_path / "b" / "final").num_heads == 5
    assert "Those were 3 heads; heads 3..4 started as copies" in (tmp_path / "b" / "final" / "README.md").read_text()
    with pytest.raises(ValueError, match="as many heads or fewer"):
        init_heads_from(config(tmp_path, num_heads=2, arch="prefix-mlp", init_from=str(src)), model)


def test_init_from_with_init_vocab_data_rechooses_the_vocabulary_and_keeps_the_weights(tmp_path, model):
    cache = make_cache(tmp_path / "data", model)
    train_heads(config(tmp_path, run_name="a", epochs=1), model, cache=cache, measure=False)
    src = DraftHeads.from_pretrained(tmp_path / "a" / "final")
    other = make_cache(tmp_path / "other" / "data", model, n=20, seed=5)
    train_heads(
        config(
            tmp_path / "other",
            run_name="b",
            max_steps=1,
            lr=0.0,
            init_from=str(tmp_path / "a" / "final"),
            init_vocab="data",
        ),
        model,
        cache=other,
        measure=False,
    )
    got = DraftHeads.from_pretrained(tmp_path / "other" / "b" / "final")
    want = draft_vocabulary(supervised_tokens(other, SPLIT_TRAIN), 48, V)
    assert torch.equal(got.draft_vocab, want) and not torch.equal(got.draft_vocab, src.draft_vocab)
    for (name, p), q in zip(src.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name  # lr 0: the weights are the given heads'
    with pytest.raises(ValueError, match="init_vocab"):
        config(tmp_path, init_vocab="fresh")


def test_feature_layers_extend_an_eagle_drafter_at_zero_and_train(tmp_path, model):
    """``--feature-layers`` on an EAGLE-1 drafter: the extended drafter first scores what the given
    one scored (its ``fuse`` is zero), then trains on a cache that keeps those states."""
    from entmtp_hf.tools.training.loop import init_heads_from, param_groups

    cache = make_cache(tmp_path / "data", model, feature_layers=[0, 1])
    train_heads(
        config(tmp_path, run_name="a", epochs=1, family="eagle", arch="eagle"), model, cache=cache, measure=False
    )
    src = tmp_path / "a" / "final"
    given = DraftHeads.from_pretrained(src).float()
    fused = config(
        tmp_path,
        run_name="b",
        epochs=2,
        family="eagle",
        arch="eagle",
        feature_layers=(0, 1),
        init_from=str(src),
        lr=1e-3,
        fuse_lr=3e-2,
    )
    got = init_heads_from(fused, model)
    groups = param_groups(got, fused)
    assert [g["lr"] for g in groups] == [1e-3, 3e-2] and [id(p) for p in groups[1]["params"]] == [
        id(p) for p in (got.fuse.weight, *got.fuse_norms.parameters())
    ]
    assert got.feature_layers == (0, 1, -1) and not got.fuse.weight.any()
    b = cache.batch([0, 1], got.feature_layers)
    embed, lm = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        for x, y in zip(
            got.forward_train(b["features"], b["ids"], embed, lm), given.forward_train(b["hidden"], b["ids"], embed, lm)
        ):
            assert torch.allclose(x, y, atol=1e-6)
    summary = train_heads(fused, model, cache=cache, measure=False)
    trained = DraftHeads.from_pretrained(tmp_path / "b" / "final")
    assert trained.feature_layers == (0, 1, -1) and trained.fuse.weight.any()
    assert "plus a projection of its states 0, 1" in (tmp_path / "b" / "final" / "README.md").read_text()
    assert summary["loss_curve"][-1] < summary["loss_curve"][0]
    with pytest.raises(ValueError, match="keeps the last one and no others"):  # a cache without those states
        train_heads(
            config(tmp_path / "plain", run_name="c", max_steps=1, family="eagle", arch="eagle", feature_layers=(0, 1)),
            model,
            cache=make_cache(tmp_path / "plain" / "data", model),
            measure=False,
        )
    with pytest.raises(ValueError, match="feature_layers name the base states an 'eagle' or 'eagle3' drafter fuses"):
        config(tmp_path, arch="mlp", feature_layers=(0,))


def test_an_eagle3_drafter_fuses_the_states_it_is_told_and_exports_them(tmp_path):
    """``--feature-layers`` on eagle3: the drafter reads those three states (a cache may keep more),
    trains, and its export names them for the engines; the last layer's output, normed in
    transformers and unnormed in the engines, and any count but three are refused."""
    from entmtp_hf.heads import load_heads
    from entmtp_hf.tools.export_heads import export_heads

    deep = tiny_llama(layers=4)
    cache = make_cache(tmp_path / "data", deep, n=6, feature_layers=[0, 1, 2, 3])
    cfg = config(tmp_path, family="eagle", arch="eagle3", run_name="e3", feature_layers=(3, 0, 1), epochs=1)
    assert cfg.heads_feature_layers(deep.config) == [0, 1, 3]
    assert train_heads(cfg, deep, cache=cache, measure=False)["steps"] > 0
    trained = DraftHeads.from_pretrained(tmp_path / "e3" / "final")
    assert trained.feature_layers == (0, 1, 3)
    out = export_heads(trained, "eagle3", tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert load_heads(out).feature_layers == (0, 1, 3)
    with pytest.raises(ValueError, match=r"inputs of base layers, in \[0, 3\] for this 4-layer model"):
        config(tmp_path, family="eagle", arch="eagle3", feature_layers=(0, 1, 4)).heads_feature_layers(deep.config)
    with pytest.raises(ValueError, match="fuses three base states"):
        config(tmp_path, family="eagle", arch="eagle3", feature_layers=(0, 1))
