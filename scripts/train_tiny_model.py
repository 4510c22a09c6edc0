"""Train the bundled ``kvmesh-tiny`` model's weights on CPython's standard library.

The folder (tokenizer, ``config.json``) comes from ``scripts/make_tiny_model.py``; this
script adds ``model.safetensors`` (fp32, tied embeddings stored once) and rewrites
``generation_config.json`` with the same EOS ids. It never touches the tokenizer or
``config.json``.

Data: the running interpreter's standard-library ``.py`` sources (tests, ``idlelib``,
``lib2to3``, ``turtledemo`` and the codec tables in ``encodings`` left out), tokenized
with the bundled tokenizer, files joined by ``<|endoftext|>``. A quarter of the
training windows come from a second stream of ChatML conversations made from the same
sources (user: a function's docstring, assistant: the function), so that chat prompts
get code back and ``<|im_end|>`` is learned as the end of an answer. Every 50th file
is held out for the evaluation loss.

Training: a fresh ``LlamaForCausalLM`` (transformers, the reference implementation),
AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1), 20 warm-up steps then cosine decay
to a tenth, gradient clipping at 1, batches of 8 random windows of 256 tokens.
Everything is seeded and deterministic on one machine and thread count: running it
twice with the same arguments writes the same bytes (the SHA-256 is printed).

Usage::

    python scripts/train_tiny_model.py                 # 300 steps, ~5 min on 2 cores
    python scripts/train_tiny_model.py --steps 20 --out /tmp/tiny   # a quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "src" / "kvmesh" / "models" / "kvmesh-tiny"
ENDOFTEXT, IM_END = 0, 2
EOS_IDS = [IM_END, ENDOFTEXT]  # chat EOS first, as generation_config.json has always had

_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "idlelib", "lib2to3", "turtledemo", "encodings",
}  # fmt: skip
_HOLDOUT_EVERY = 50
_WARMUP_STEPS = 20
_MAX_DOC_CHARS = 400
_MAX_FUNC_CHARS = 1500


# ---------------------------------------------------------------------------- data


def source_files(stdlib: Path) -> list[Path]:
    """Standard-library sources in a machine-independent order."""
    files = [p for p in stdlib.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        try:
            out.append(path.read_text("utf-8"))
        except UnicodeDecodeError:
            continue
    return out


def chat_examples(text: str) -> Iterator[str]:
    """ChatML conversations from one source file: a function's docstring asks, its code answers."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    # NOTE: ast.get_source_segment re-splits the file per call (quadratic); whole
    # lines from one split, dedented, give the same function text.
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        doc = ast.get_docstring(node)
        code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        if not doc or len(code) > _MAX_FUNC_CHARS:
            continue
        question = doc.strip().split("\n\n")[0][:_MAX_DOC_CHARS]
        yield f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{code}<|im_end|>\n"


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and joined, each followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(ENDOFTEXT)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` tokens (inputs and shifted targets)."""
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


# ---------------------------------------------------------------------------- training


def lr_at(step: int, steps: int, peak: float) -> float:
    if step < _WARMUP_STEPS:
        return peak * (step + 1) / _WARMUP_STEPS
    progress = (step - _WARMUP_STEPS) / max(1, steps - _WARMUP_STEPS)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def loss_of(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed + 1)
    model.eval()
    loss = sum(loss_of(model, sample_batch(stream, 8, seq, gen)).item() for _ in range(4)) / 4
    model.train()
    return loss


def train(model: LlamaForCausalLM, streams: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> None:
    code, chat = streams
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    n_chat = round(args.batch * args.chat_fraction)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        windows = torch.cat(
            [sample_batch(code, args.batch - n_chat, args.seq, gen), sample_batch(chat, n_chat, args.seq, gen)]
        )
        loss = loss_of(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step, args.steps, args.lr):.2e}  {elapsed:6.1f} s")
            sys.stdout.flush()


# ---------------------------------------------------------------------------- output


@torch.no_grad()
def show_samples(model: LlamaForCausalLM, tok: Tokenizer) -> None:
    """Greedy continuations of a few prompts, and how many distinct tokens each used."""
    model.eval()
    prompts = ["def read_file(path):\n", "import os\n\n", "<|im_start|>user\nReturn the sum of a list.<|im_end|>\n<|im_start|>assistant\n"]
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=ENDOFTEXT, eos_token_id=EOS_IDS)
        new = out[0, ids.shape[1] :].tolist()
        print(f"--- {prompt!r} -> {len(set(new))} distinct of {len(new)} tokens\n{tok.decode(new)!r}")


def save(model: LlamaForCausalLM, out: Path) -> str:
    """Write model.safetensors (the tied head stored once) and generation_config.json."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = out / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    gen_cfg = {"bos_token_id": ENDOFTEXT, "eos_token_id": EOS_IDS, "pad_token_id": ENDOFTEXT}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_out(out: Path) -> None:
    """A separate output folder gets the bundled tokenizer and configs first."""
    if out.resolve() == MODEL_DIR.resolve():
        return
    out.mkdir(parents=True, exist_ok=True)
    for f in MODEL_DIR.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja"):
            shutil.copy2(f, out / f.name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=MODEL_DIR, help="model folder to write (default: the bundled one)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chat-fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or not 0 <= args.chat_fraction < 1:
        p.error("--steps, --batch >= 1, --seq >= 2, 0 <= --chat-fraction < 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    prepare_out(args.out)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    t0 = time.perf_counter()
    files = source_files(Path(sysconfig.get_paths()["stdlib"]))
    texts = read_texts(files)
    train_texts = [t for i, t in enumerate(texts) if i % _HOLDOUT_EVERY]
    held_out = token_stream(tok, [t for i, t in enumerate(texts) if i % _HOLDOUT_EVERY == 0])
    code = token_stream(tok, train_texts)
    chat = token_stream(tok, [c for t in train_texts for c in chat_examples(t)])
    print(f"corpus: {len(texts)} files, {len(code):,} code tokens, {len(chat):,} chat tokens, "
          f"{len(held_out):,} held-out tokens ({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    config = LlamaConfig.from_pretrained(str(MODEL_DIR))
    model = LlamaForCausalLM(config)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters ({params * 4 / 1e6:.1f} MB fp32)")
    print(f"held-out loss before: {eval_loss(model, held_out, args.seq, args.seed):.4f}")
    t1 = time.perf_counter()
    train(model, (code, chat), args)
    print(f"trained {args.steps} steps in {time.perf_counter() - t1:.1f} s")
    print(f"held-out loss after: {eval_loss(model, held_out, args.seq, args.seed):.4f}")
    digest = save(model, args.out)
    print(f"wrote {args.out / 'model.safetensors'} sha256 {digest}")
    show_samples(model, tok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
