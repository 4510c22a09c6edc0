"""Picking next tokens from a pass's logits: greedy, sampled, with logprobs.

Pure torch on one batch of logit rows; runs in the engine's forward thread. Each row
carries its :class:`SampleParams`. Order for one row (vLLM's):

0. a guided row (structured outputs) gets ``-inf`` on every token its grammar does
   not allow next (:class:`~kvmesh.preprocess.guided.Guide`), and its grammar then
   consumes the token drawn;
1. ``banned`` ids get ``-inf`` (EOS and stop ids while ``min_tokens`` are not out yet);
2. penalties over earlier tokens (``repetition_penalty`` on prompt + output,
   ``presence``/``frequency`` on output, OpenAI's definitions);
3. logprobs (when asked) are taken here, from the log-softmax of these logits, before
   temperature and truncation: the model's distribution, as OpenAI reports it;
4. temperature 0 (or ``top_k == 1``): argmax. Otherwise divide by temperature, keep
   the ``top_k`` best, then the smallest set reaching ``top_p``, then drop tokens under
   ``min_p`` × the best probability, and draw with the row's ``torch.Generator``.

A seeded request has its own generator, so its draws depend only on its seed and its
logits, not on what else is in the batch.

On a GPU the logits stay on the device: bans, penalties, grammar masks, argmax and
logprobs run there, and a greedy batch costs one device→host copy (its token ids). A
sampled row is drawn on the host, from its float32 probabilities, with the request's
CPU generator: the same seed draws the same tokens on either device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.guided import Guide
from kvmesh.protocol import PreprocessedRequest, TokenLogprob

__all__ = ["SampleParams", "Sampled", "sample", "params_for", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SampleParams:
    """How to pick one row's token. ``generator`` None: greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    logprobs: int | None = None
    banned: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    history: tuple[int, ...] = ()  # prompt + output, for the repetition penalty
    output: tuple[int, ...] = field(default_factory=tuple)  # output only, for presence/frequency
    guide: Guide | None = None  # the request's grammar (structured outputs), shared across steps
    remaining: int | None = None  # tokens of budget left (the guide closes the output in time)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: TokenLogprob | None


def params_for(request: PreprocessedRequest, vocab_size: int, default_seed: torch.Generator) -> SampleParams:
    """The request's sampling options checked and turned into :class:`SampleParams`
    (history, output and banned ids are filled per step). Raises InvalidArgument."""
    s = request.sampling
    temperature = 1.0 if s.temperature is None else float(s.temperature)
    top_k = 0 if s.top_k in (None, -1) else int(s.top_k)
    top_p = 1.0 if s.top_p is None else float(s.top_p)
    min_p = 0.0 if s.min_p is None else float(s.min_p)
    _check(temperature >= 0, f"temperature must be >= 0, got {temperature}")
    _check(top_k >= 0, f"top_k must be -1 (off) or positive, got {s.top_k}")
    _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}")
    _check(0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}")
    rep = 1.0 if s.repetition_penalty is None else float(s.repetition_penalty)
    _check(rep > 0, f"repetition_penalty must be > 0, got {rep}")
    n = request.output.logprobs
    _check(n is None or 0 <= n <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
    params = SampleParams(
        temperature=temperature,
        top_k=min(top_k, vocab_size),
        top_p=top_p,
        min_p=min_p,
        logprobs=n,
        repetition_penalty=rep,
        presence_penalty=float(s.presence_penalty or 0.0),
        frequency_penalty=float(s.frequency_penalty or 0.0),
    )
    if not params.greedy:
        if s.seed is not None:
            params.generator = torch.Generator().manual_seed(int(s.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        else:
            params.generator = default_seed
    return params


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def sample(logits: torch.Tensor, params: list[SampleParams]) -> list[Sampled]:
    """One token (and its logprobs, when asked) per row of ``logits`` (S, vocab), any
    device and float dtype (read as float32). The rows' argmaxes and every asked-for
    log-probability table come to the host together (:class:`_Logprobs`): no copy per row."""
    logits = _adjust(logits.float(), params)
    greedy = logits.argmax(dim=-1)
    tables = _Logprobs(logits, params, greedy)
    greedy_ids = greedy.tolist()
    tokens = []
    for i, p in enumerate(params):
        token = greedy_ids[i] if p.greedy else _draw(logits[i], p)
        if p.guide is not None:
            token = p.guide.settle(token, p.remaining)
            p.guide.consume(token)
        tokens.append(token)
    return [Sampled(t, tables.of(i, t)) for i, t in enumerate(tokens)]


class _Logprobs:
    """The log-softmax top-n of the rows that ask for logprobs, computed on the logits'
    device for all of them at once; :meth:`of` a row's entry for the token it got (its
    top-1 when that is the token, else one gather for those rows)."""

    def __init__(self, logits: torch.Tensor, params: list[SampleParams], greedy: torch.Tensor) -> None:
        self.params = params
        self.rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.where = {row: k for k, row in enumerate(self.rows)}
        if not self.rows:
            return
        index = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        self.logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
        n = max(1, max(params[i].logprobs or 0 for i in self.rows))
        values, ids = torch.topk(self.logp, min(n, self.logp.shape[1]))
        self.top_values, self.top_ids = values.tolist(), ids.tolist()

    def of(self, row: int, token: int) -> TokenLogprob | None:
        k = self.where.get(row)
        if k is None:
            return None
        n = self.params[row].logprobs or 0
        top = list(zip(self.top_ids[k][:n], self.top_values[k][:n], strict=True))
        value = self.top_values[k][0] if self.top_ids[k][0] == token else float(self.logp[k, token])
        return TokenLogprob(token, value, top)


def _adjust(logits: torch.Tensor, params: list[SampleParams]) -> torch.Tensor:
    """Bans and penalties, on a copy only when some row needs them."""
    if not any(p.banned or p.penalised or p.guide is not None for p in params):
        return logits
    logits = logits.clone()
    for i, p in enumerate(params):
        row = logits[i]
        if p.penalised:
            _penalise(row, p)
        if p.banned:
            row[torch.tensor(p.banned, dtype=torch.long, device=row.device)] = float("-inf")
    guided = [i for i, p in enumerate(params) if p.guide is not None]
    if guided:
        _guide(logits, guided, params)
    return logits


def _guide(logits: torch.Tensor, rows: list[int], params: list[SampleParams]) -> None:
    """``-inf`` on what each guided row's grammar forbids, in one masked fill for all of
    them. A ban (``min_tokens``) that would leave a row nothing allowed gives way to the
    grammar: the output must stay valid."""
    vocab = logits.shape[1]
    masks = np.zeros((len(rows), vocab), dtype=np.bool_)
    for k, i in enumerate(rows):
        p = params[i]
        assert p.guide is not None
        allowed = p.guide.allowed(p.remaining)
        n = min(vocab, allowed.shape[0])
        masks[k, :n] = allowed[:n]
    allowed_t = torch.from_numpy(masks).to(logits.device)
    whole = len(rows) == logits.shape[0]
    sub = logits if whole else logits[rows]
    sub.masked_fill_(allowed_t.logical_not(), float("-inf"))
    dead = torch.isneginf(sub.max(dim=1).values)
    if bool(dead.any()):  # the bans took the grammar's last choices
        sub[dead] = torch.where(allowed_t[dead], 0.0, float("-inf"))
    if not whole:
        logits[rows] = sub


def _penalise(row: torch.Tensor, p: SampleParams) -> None:
    if p.repetition_penalty != 1.0 and p.history:
        seen = torch.tensor(sorted(set(p.history)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and p.output:
        counts = Counter(p.output)
        ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
        n = torch.tensor(list(counts.values()), dtype=row.dtype, device=row.device)
        row[ids] -= p.frequency_penalty * n + p.presence_penalty


def _draw(row: torch.Tensor, p: SampleParams) -> int:
    scaled = row.cpu() / p.temperature  # the request's generator is a CPU one (a no-op on the CPU)
    if p.top_k:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token while the mass before it is under top_p (the first is always kept)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=p.generator).item())
