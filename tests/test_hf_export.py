"""Hugging Face export: ``python -m lightning_ragged.consolidate CKPT OUT --format hf`` and ``save_pretrained``.

Oracle: a tiny ``transformers`` Llama (from config, nothing downloaded) trained 3 AdamW steps
under ``fully_shard`` at 2 gloo ranks; its full state dict loaded into a fresh model gives the
reference logits. The exported directory, loaded by ``from_pretrained``, must give the same
logits (≤ 1e-6, fp32) with no missing or unexpected keys: untied (no prefix, one file and
many small files + index) and tied embeddings (held by a LightningModule-like ``.model``
attribute, so ``--prefix model.`` is stripped; the tied head written once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.hf_models import VOCAB, make_tokens

STEPS, BATCH = 3, 4


def _config(tied: bool):
    from transformers import LlamaConfig

    # The tied config names its class (the export builds it); the untied one leaves the auto class to match the names.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       initializer_range=0.1, tie_word_embeddings=tied,
                       architectures=["LlamaForCausalLM"] if tied else None)


class Holder(nn.Module):
    """A LightningModule's shape: the Hugging Face model under ``.model`` (state-dict names gain ``model.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _train_and_save(root: str, tied: bool) -> dict | None:
    import lightning_ragged as lr
    from lightning_ragged import checkpoint as ck
    from lightning_ragged.engine.state_dict import full_state_dict
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = Holder(LlamaForCausalLM(_config(tied)))
    sharded = lr.fully_shard(model if tied else model.model)
    forward = sharded if tied else (lambda tokens: sharded(input_ids=tokens).logits)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in make_tokens(STEPS, BATCH):
        local = batch[rank * BATCH // world : (rank + 1) * BATCH // world]
        logits = forward(local)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), local[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ck.save(f"{root}/ckpt", sharded)
    hf_model = sharded.model if tied else sharded
    assert isinstance(hf_model, LlamaForCausalLM)
    hf_model.save_pretrained(f"{root}/pretrained")  # the live sharded model: gathered to rank 0, written there
    everywhere = full_state_dict(hf_model)  # accelerate's idiom: the full state dict, then rank 0 alone writes it
    refused = None
    if rank == 0:
        hf_model.save_pretrained(f"{root}/given", state_dict=everywhere)  # before: refused, rank 1 left waiting
        try:
            hf_model.save_pretrained(f"{root}/shards", state_dict=hf_model.state_dict())
        except ValueError as error:
            refused = str(error)
    dist.barrier()
    full = full_state_dict(hf_model, cpu_offload=True, rank0_only=True)
    return {"full": {k: v.clone() for k, v in full.items()}, "refused": refused} if rank == 0 else None


@pytest.fixture(scope="module")
def trained(dist_pool, tmp_path_factory) -> dict:
    runs = {}
    for tied in (False, True):
        root = tmp_path_factory.mktemp(f"hf_tied{int(tied)}")
        result = dist_pool(2).run(_train_and_save, str(root), tied)[0]
        _config(tied).save_pretrained(root / "config")
        runs[tied] = dict(root=root, full=result["full"], refused=result["refused"])
    return runs


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=make_tokens(1, 4, seed=7)[0]).logits


def _reference_logits(run: dict, tied: bool) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    fresh = LlamaForCausalLM(_config(tied))
    fresh.load_state_dict(run["full"])
    return _logits(fresh)


def _from_pretrained(path: Path) -> tuple[nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    model, loading = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert model.dtype == torch.float32
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    return model, loading


def _spy_reads(monkeypatch) -> list[int]:
    """Bytes of every DCP read the export makes (each is one file's tensors)."""
    from lightning_ragged.checkpoint.reader import CheckpointInfo

    sizes: list[int] = []
    original = CheckpointInfo.read_locally

    def read_locally(self, template):
        leaves = [t for part in template.values() for t in part.values()]
        sizes.append(sum(t.numel() * t.element_size() for t in leaves))
        return original(self, template)

    monkeypatch.setattr(CheckpointInfo, "read_locally", read_locally)
    return sizes


@pytest.mark.parametrize("max_shard_size", [None, "20KB"])
def test_hf_export_loads_with_from_pretrained_and_gives_the_trained_logits(trained, tmp_path, monkeypatch, max_shard_size) -> None:
    from lightning_ragged.cli.consolidate import main

    run = trained[False]
    sizes = _spy_reads(monkeypatch)
    out = tmp_path / "out"
    flags = ["--max-shard-size", max_shard_size] if max_shard_size else []
    assert main([str(run["root"] / "ckpt"), str(out), "--format", "hf", "--config", str(run["root"] / "config"), *flags]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if max_shard_size is None:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    else:
        count = len(files)
        assert count >= 4 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(run["full"]) and set(index["weight_map"].values()) == set(files)
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in run["full"].values())
        largest = max(v.numel() * 4 for v in run["full"].values())
        assert len(sizes) == count and max(sizes) <= max(20_000, largest)  # one file's tensors in memory at a time
    model, _ = _from_pretrained(out)
    assert (_logits(model) - _reference_logits(run, False)).abs().max().item() <= 1e-6


def test_tied_embeddings_are_written_once_and_the_prefix_is_stripped(trained, tmp_path) -> None:
    from safetensors import safe_open

    from lightning_ragged.cli.consolidate import main

    run = trained[True]
    out = tmp_path / "out"
    argv = [str(run["root"] / "ckpt"), str(out), "--format", "hf", "--config", str(run["root"] / "config" / "config.json"),
            "--prefix", "model.", "--max-shard-size", "30KB"]
    assert main(argv) == 0
    written = set()
    for path in out.glob("*.safetensors"):
        with safe_open(path, framework="pt") as handle:
            written |= set(handle.keys())
    assert written == set(run["full"]) - {"lm_head.weight"}  # as save_pretrained: the tied head dropped
    model, _ = _from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (_logits(model) - _reference_logits(run, True)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_of_a_sharded_model_gives_the_trained_logits(trained, tied) -> None:
    run = trained[tied]
    model, _ = _from_pretrained(run["root"] / "pretrained")
    assert (_logits(model) - _reference_logits(run, tied)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_on_rank_0_with_a_full_state_dict_writes_it(trained, tied) -> None:
    run = trained[tied]
    model, _ = _from_pretrained(run["root"] / "given")
    assert (_logits(model) - _reference_logits(run, tied)).abs().max().item() <= 1e-6
    assert "this rank's shard" in run["refused"] and "full_state_dict" in run["refused"], run["refused"]
    assert not (run["root"] / "shards").exists()


def test_hf_export_refuses_a_wrong_prefix_and_bad_options(trained, tmp_path, capsys) -> None:
    from lightning_ragged.cli.consolidate import main

    run = trained[True]
    ckpt, config = str(run["root"] / "ckpt"), str(run["root"] / "config")
    assert main([ckpt, str(tmp_path / "a"), "--format", "hf", "--config", config]) == 1  # names keep "model."
    assert "--prefix" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([ckpt, str(tmp_path / "b"), "--format", "hf", "--prefix", "nope."]) == 1
    assert "prefix='nope.'" in capsys.readouterr().err and not (tmp_path / "b").exists()
    for argv in (["--format", "hf", "--max-shard-size", "lots"], ["--config", config]):  # bad size; hf option without hf
        with pytest.raises(SystemExit):
            main([ckpt, str(tmp_path / "c"), *argv])
        assert "--" in capsys.readouterr().err
