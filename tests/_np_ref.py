"""Independent float64 numpy references for the algorithm tests, written from the papers' formulas with plain
loops (deliberately not vectorised like the JAX code, so a shared mistake is unlikely)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

EPS = 1e-8


def mmean(x, m):
    x, m = np.asarray(x, np.float64), np.asarray(m, np.float64)
    return (x * m).sum() / (m.sum() + EPS)


def whiten(x, m):
    x, m = np.asarray(x, np.float64), np.asarray(m, np.float64)
    vals = x[m > 0]
    mean = vals.mean()
    var = ((vals - mean) ** 2).sum() / (len(vals) - 1)
    return (x - mean) / np.sqrt(var + EPS)


def groups(index):
    g = defaultdict(list)
    for i, k in enumerate(index):
        g[int(k)].append(i)
    return g


def gae(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        next_v, last = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                delta = rewards[b, t] + gamma * next_v - values[b, t]
                last = delta + gamma * lam * last
                next_v = values[b, t]
                adv[b, t] = last
            else:  # skipped position: carries the running estimate, value computed but not used
                adv[b, t] = last
    returns = adv + values
    return whiten(adv, mask), returns


def grpo(rewards, mask, index, norm=True, eps=1e-6):
    s = rewards.sum(-1)
    out = np.zeros(len(s))
    for _, ids in groups(index).items():
        g = s[ids]
        mean, std = (0.0, 1.0) if len(ids) == 1 else (g.mean(), g.std(ddof=1))
        for i in ids:
            out[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    return out[:, None] * mask


def rloo(rewards, mask, index):
    s = rewards.sum(-1)
    out = s.copy()
    for _, ids in groups(index).items():
        if len(ids) > 1:
            for i in ids:
                out[i] = s[i] - sum(s[j] for j in ids if j != i) / (len(ids) - 1)
    return out[:, None] * mask


def opo(rewards, mask, index):
    s = rewards.sum(-1)
    lens = mask.sum(-1)
    out = np.zeros(len(s))
    for _, ids in groups(index).items():
        b = 0.0 if len(ids) == 1 else sum(lens[i] * s[i] for i in ids) / sum(lens[i] for i in ids)
        for i in ids:
            out[i] = s[i] - b
    return out[:, None] * mask


def reinforce_pp(rewards, mask, gamma):
    B, T = rewards.shape
    ret = np.zeros((B, T))
    for b in range(B):
        run = 0.0
        for t in reversed(range(T)):
            run = rewards[b, t] + gamma * run
            ret[b, t] = run
            run *= mask[b, t]
    return whiten(ret, mask) * mask, ret


def reinforce_pp_baseline(rewards, mask, index):
    s = rewards.sum(-1)
    out = np.zeros(len(s))
    for _, ids in groups(index).items():
        mean = 0.0 if len(ids) == 1 else s[ids].mean()
        for i in ids:
            out[i] = s[i] - mean
    a = out[:, None] * mask
    return whiten(a, mask) * mask


def remax(rewards, mask, baselines):
    B, T = rewards.shape
    ret = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            ret[b, t] = sum(rewards[b, u] * mask[b, u] for u in range(t, T))
    return ret - baselines[:, None] * mask, ret


def gpg(rewards, mask, index, f_norm=1.0):
    s = rewards.sum(-1)
    alpha = len(s) / max(np.count_nonzero(s), 1)
    out = np.zeros(len(s))
    for _, ids in groups(index).items():
        mean = 0.0 if len(ids) == 1 else s[ids].mean()
        for i in ids:
            out[i] = alpha * (s[i] - mean) / f_norm
    return out[:, None] * mask


def agg(loss, mask, mode, scale=None):
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    rows = [(loss[i] * mask[i]).sum() for i in range(len(loss))]
    counts = mask.sum(-1)
    valid = [i for i in range(len(loss)) if counts[i] > 0]
    if mode == "seq-mean-token-mean":
        return np.mean([rows[i] / counts[i] for i in valid])
    if mode == "seq-mean-token-sum":
        return np.mean([rows[i] for i in valid])
    if mode == "seq-mean-token-sum-norm":
        return np.mean([rows[i] for i in valid]) / (loss.shape[-1] if scale is None else scale)
    if mode == "token-sum":
        return (loss * mask).sum()
    raise ValueError(mode)


def ppo_clip(old, new, adv, mask, mode, lo, hi, c):
    """Returns (loss, per-token losses, clipfrac, clipfrac_lower, ppo_kl)."""
    B, T = adv.shape
    L = np.zeros((B, T))
    clip_hits, lower_hits = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            lr = min(max(new[b, t] - old[b, t], -20.0), 20.0)
            r = np.exp(lr)
            a = adv[b, t]
            unclipped = -a * r
            clipped = -a * min(max(r, 1 - lo), 1 + hi)
            ell = max(unclipped, clipped)
            clip_hits[b, t] = clipped > unclipped
            if a < 0:
                lower_hits[b, t] = ell > -a * c
                ell = min(ell, -a * c)
            L[b, t] = ell
    kl = mmean(-(np.clip(new - old, -20, 20)), mask)
    return agg(L, mask, mode), L, mmean(clip_hits, mask), mmean(lower_hits, mask), kl


def k3(lp, ref):
    x = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def log_softmax(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def entropy(z):
    lp = log_softmax(z)
    return -(np.exp(lp) * lp).sum(-1)
