"""Train a small GPT-style character language model with ``Trainer(strategy="ragged_fsdp")``.

    python examples/train_gpt.py                     # CPU, 2 processes, 30 steps (< 1 min)
    python examples/train_gpt.py --precision bf16-mixed --max-steps 60
    python examples/train_gpt.py --accelerator gpu --devices 8 --n-layer 12 --n-embd 768

Everything is in this file: the model (random init, built from plain ``nn.Linear`` /
``nn.Embedding`` / ``nn.LayerNorm``), a tiny public-domain corpus, a character
tokenizer, a LightningDataModule, and torchmetrics' perplexity. The only line that
differs from a DDP script is ``strategy="ragged_fsdp"``. The GPT is built in
``configure_model`` on the meta device and materialized by the strategy one FSDP group at
a time (``reset_parameters`` under a seed shared by all ranks), so no rank ever holds the
whole model during init. (``with trainer.init_module(empty_init=True): model = ...``
works the same way for models built in ``__init__``.)
"""

from __future__ import annotations

import argparse
import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

try:
    import lightning_ragged  # noqa: F401  (registers strategy="ragged_fsdp")
except ImportError:  # running from a source checkout without `pip install -e .`
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_ragged  # noqa: F401

# The opening of Jane Austen, "Pride and Prejudice" (1813), public domain.
TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in
want of a wife. However little known the feelings or views of such a man may be on his first entering
a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is
considered the rightful property of some one or other of their daughters. "My dear Mr. Bennet," said
his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied that
he had not. "But it is," returned she; "for Mrs. Long has just been here, and she told me all about
it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" cried his wife
impatiently. "You want to tell me, and I have no objection to hearing it." This was invitation enough.
"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune
from the north of England; that he came down on Monday in a chaise and four to see the place, and was
so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession
before Michaelmas, and some of his servants are to be in the house by the end of next week."
"""

CHARS = sorted(set(TEXT))
VOCAB_SIZE = len(CHARS)


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(CHARS)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


# ---------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """One transformer block: ``RaggedFSDPStrategy`` makes each one an FSDP group by default."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTLightning(L.LightningModule):
    """Next-character prediction with AdamW (weight decay on matrices only) and perplexity."""

    def __init__(
        self,
        n_layer: int = 2,
        n_embd: int = 64,
        n_head: int = 4,
        block_size: int = 64,
        lr: float = 1e-2,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()

    def configure_model(self) -> None:
        if self.model is not None:  # called again by a later fit/validate/test
            return
        hp = self.hparams
        with torch.device("meta"):  # no memory: the strategy materializes one group at a time
            self.model = GPT(VOCAB_SIZE, hp.block_size, hp.n_layer, hp.n_embd, hp.n_head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], metric: Perplexity) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs).float()
        metric(logits, targets)  # forward: updates the state and caches the batch value for the bar
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, self.train_ppl)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_ppl", self.train_ppl, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._step(batch, self.val_ppl)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The parameters are the local shards, under their original names: group them by name.
        matrices = [p for n, p in self.named_parameters() if n.endswith("weight") and "ln" not in n]
        others = [p for n, p in self.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
        return torch.optim.AdamW(
            [{"params": matrices, "weight_decay": self.hparams.weight_decay}, {"params": others, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )


# ----------------------------------------------------------------------------- data
class CharWindows(Dataset):
    """Windows of ``block_size + 1`` characters starting at every ``stride``-th position."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int = 1) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.starts = list(range(0, len(tokens) - block_size - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[self.starts[index] : self.starts[index] + self.block_size + 1]
        return window[:-1], window[1:]


class CharDataModule(L.LightningDataModule):
    """90% / 10% split of the embedded text; Lightning adds the ``DistributedSampler``."""

    def __init__(self, block_size: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size

    def setup(self, stage: str) -> None:
        tokens = encode(TEXT)
        split = int(0.9 * len(tokens))
        self.train = CharWindows(tokens[:split], self.block_size)
        self.val = CharWindows(tokens[split - self.block_size :], self.block_size, stride=8)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--precision", default="32-true", help="32-true | bf16-mixed | bf16-true")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    L.seed_everything(args.seed)
    trainer = L.Trainer(
        strategy="ragged_fsdp",  # the one-string switch (was "ddp")
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=10,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
    )
    model = GPTLightning(args.n_layer, args.n_embd, args.n_head, args.block_size)
    data = CharDataModule(args.block_size, args.batch_size)
    trainer.fit(model, data)

    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        parameters = sum(p.ragged_shard.numel for p in model.parameters())
        print(
            f"\n{parameters:,} parameters sharded over {trainer.world_size} processes; "
            f"final train_loss {metrics['train_loss']:.3f} (uniform guess: {math.log(VOCAB_SIZE):.3f}), "
            f"val_ppl {metrics.get('val_ppl', float('nan')):.2f}"
        )


if __name__ == "__main__":
    main()
