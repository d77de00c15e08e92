"""A tiny vision-language model trained on CPU from zephon-flow, checkpointed and resumed on the same batches.

    python examples/train_tiny_vlm.py --steps 40 --checkpoint-every 10 --out run-vlm/
    python examples/train_tiny_vlm.py --steps 40 --out run-vlm/ --resume run-vlm/step-000010

The data is made here, offline: ``--images`` captioned pictures drawn with Pillow (a coloured
shape on a coloured background, the caption saying which), written as WebDataset ``.tar``
shards, and a byte-level BPE trained on the captions with an ``<image>`` token. The pipeline
is the README's multimodal one: ``ReadWebDataset -> DecodeImage -> ResizeImage ->
TokenizeField -> PackMultimodal``. The model embeds each image as ``tokens_per_image``
patches in place of its ``<image>`` placeholders and predicts the caption tokens (attention
stays inside each sample, ``segment_ids``). Every ``--checkpoint-every`` steps model,
optimizer and data state go into one ``torch.distributed.checkpoint`` directory; per step
``log.jsonl`` gets the step, the loss and the batch digest, so a resumed run shows the same
batches (and, on one machine, the same losses) as the run it resumes.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apache_beam as beam
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.torch import ZephonDataset

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
SIZE, PATCH = 16, 8  # 16x16 images, 8x8 patches: 4 image tokens each
TOKENS_PER_IMAGE = (SIZE // PATCH) ** 2
SEQ_LEN, MAX_IMAGES = 48, 4
IMAGE, EOS = "<image>", "<|endoftext|>"


# -- the data ----------------------------------------------------------------------------------
def draw(shape: str, colour: str, background: str, rng: random.Random) -> bytes:
    image = Image.new("RGB", (32, 32), COLOURS[background])
    pen = ImageDraw.Draw(image)
    x, y, r = rng.randint(10, 22), rng.randint(10, 22), rng.randint(6, 9)
    box = (x - r, y - r, x + r, y + r)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_shards(folder: Path, images: int, *, per_shard: int = 64, seed: int = 0) -> tuple[str, list[str]]:
    """WebDataset shards of captioned pictures; returns their glob and the captions."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, captions = random.Random(seed), []
    for shard in range(0, images, per_shard):
        with tarfile.open(folder / f"shapes-{shard // per_shard:04d}.tar", "w") as tar:
            for i in range(shard, min(images, shard + per_shard)):
                colour, background = rng.sample(sorted(COLOURS), 2)
                shape = rng.choice(SHAPES)
                caption = f"a {colour} {shape} on a {background} background"
                captions.append(caption)
                for ext, data in (("jpg", draw(shape, colour, background, rng)), ("txt", caption.encode())):
                    member = tarfile.TarInfo(f"{i:06d}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return str(folder / "shapes-*.tar"), captions


def write_tokenizer(path: Path, captions: list[str]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS, IMAGE],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(captions, trainer)
    tok.save(str(path))
    return str(path)


def make_spec(data: Path, images: int) -> tuple[zf.LoaderSpec, int, int]:
    """The pipeline over freshly written data; also the vocabulary size and ``<image>``'s id."""
    shards, captions = write_shards(data / "shards", images)
    tokenizer = write_tokenizer(data / "tokenizer.json", captions)
    tok = Tokenizer.from_file(tokenizer)
    image_id = tok.token_to_id(IMAGE)
    if image_id is None:
        raise SystemExit(f"the tokenizer has no {IMAGE!r} token")

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "shards" >> ops.ReadWebDataset(shards, samples_per_split=32)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(draft_size=SIZE))
        resized = decoded | "resize" >> beam.ParDo(ops.ResizeImage(SIZE))
        captioned = resized | "caption" >> beam.ParDo(ops.TokenizeField(tokenizer, field="txt"))
        packed = captioned | "pack" >> beam.ParDo(
            ops.PackMultimodal(
                SEQ_LEN, image_token_id=image_id, tokens_per_image=TOKENS_PER_IMAGE, max_images=MAX_IMAGES
            )
        )
        return packed | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=8), tok.get_vocab_size(), image_id


# -- the model ---------------------------------------------------------------------------------
class TinyVLM(nn.Module):
    """A small causal transformer whose placeholder tokens (``image_id``) are replaced by the
    embeddings ``embed_media`` gives (``train_tiny_video.py`` overrides it for video frames)."""

    def __init__(
        self,
        vocab: int,
        image_id: int,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        *,
        seq_len: int = SEQ_LEN,
        patch_values: int = PATCH * PATCH * 3,
    ) -> None:
        super().__init__()
        self.image_id, self.seq_len = image_id, seq_len
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.patches = nn.Linear(patch_values, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def embed_media(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's image tokens, in placeholder order: ``[B, max_images * 4, dim]``."""
        images = batch["images"].float() / 255.0  # [B, max_images, H, W, C]
        b, m = images.shape[:2]
        patches = images.reshape(b, m, SIZE // PATCH, PATCH, SIZE // PATCH, PATCH, 3)
        patches = patches.permute(0, 1, 2, 4, 3, 5, 6).reshape(b, m * TOKENS_PER_IMAGE, -1)
        return self.patches(patches)  # type: ignore[no-any-return]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"].long()
        x = self.tokens(ids) + self.positions(batch["position_ids"].long())
        embedded = self.embed_media(batch)
        slots = ids == self.image_id
        for row in range(ids.shape[0]):
            count = int(slots[row].sum())
            x[row, slots[row]] = embedded[row, :count]
        seg = batch["segment_ids"].long()
        causal = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool).tril()
        allowed = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        allowed |= torch.eye(self.seq_len, dtype=torch.bool)  # padding attends to itself
        mask = ~allowed.repeat_interleave(self.blocks.layers[0].self_attn.num_heads, dim=0)
        return self.head(self.blocks(x, mask=mask))  # type: ignore[no-any-return]


def loss_of(model: TinyVLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch)
    ids, seg = batch["input_ids"].long(), batch["segment_ids"].long()
    target = ids[:, 1:].clone()
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    target[~same | (target == model.image_id)] = -100  # predict caption tokens within a sample
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
    )


# -- training ----------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = Path(args.out)
    spec, vocab, image_id = make_spec(out / "data", args.images)
    model = TinyVLM(vocab, image_id)
    return fit(ZephonDataset.from_loader(spec), model, lambda batch: loss_of(model, batch), args)


def fit(
    ds: ZephonDataset,
    model: nn.Module,
    loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Trains ``model`` on ``ds``'s batches to step ``args.steps`` (resuming from
    ``args.resume`` if given), a DCP checkpoint of model, optimizer and data every
    ``args.checkpoint_every`` steps under ``args.out``; the step, loss and batch digest of each
    step go to ``args.out/log.jsonl`` and are returned. ``train_tiny_video.py`` trains with it too."""
    out = Path(args.out)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.resume:
        # get_state_dict gives the optimizer's state its full shape (moments included) to load into.
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state, "data": ds}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
        print(f"resumed from {args.resume} at step {ds.next_step}")
    logged = []
    with open(out / "log.jsonl", "a", encoding="utf-8") as log:
        for step, batch in DataLoader(ds, batch_size=None, num_workers=0):
            if step >= args.steps:
                break
            loss = loss_fn(batch)
            optim.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optim.step()
            digest = zf.batch_digest({k: v.numpy() for k, v in batch.items()})
            logged.append({"step": step, "loss": loss.item(), "digest": digest})
            log.write(json.dumps(logged[-1]) + "\n")
            log.flush()  # a run killed later keeps its lines (to compare with the resumed run)
            if (step + 1) % args.checkpoint_every == 0:
                where = out / f"step-{step + 1:06d}"
                model_state, optim_state = get_state_dict(model, optim)
                # A resumed run writes the later checkpoints again (DCP warns that it replaces them).
                dcp.save({"model": model_state, "optim": optim_state, "data": ds}, checkpoint_id=where)
                print(f"step {step}: loss {loss.item():.3f}; checkpoint at step {step + 1}: {where}")
    return logged


def arguments(description: str, out: str) -> argparse.ArgumentParser:
    """The options of a training run (``fit``'s); the caller adds its data's."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--out", default=out)
    parser.add_argument("--resume", help="a checkpoint directory OUT/step-NNNNNN")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = arguments("train a tiny VLM from zephon-flow on CPU", "run-vlm")
    parser.add_argument("--images", type=int, default=256)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return train(args)


if __name__ == "__main__":
    main()
