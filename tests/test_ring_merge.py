"""The ring's LSE merge (flash_ext/distributed/merge.py) against the split-KV combine's rule, written here in
float64 from its statement in csrc/flash_ext/combine.h: over the partials of a row, a NaN LSE makes O and LSE
NaN; partials that saw no key (flash_ext's ops report LSE = +inf, O = 0) weigh 0; a row no partial saw gets
O = 0 and LSE = +inf; otherwise LSE = log sum exp(LSE_s) and O = sum exp(LSE_s - LSE) O_s."""
from __future__ import annotations

import math

import pytest
import torch

from flash_ext.distributed.merge import finalize, merge_partial_


def combine_rule(outs, lses):
    """outs: list of (b, s, h, d), lses: list of (b, h, s) (+inf = empty partial).  Float64."""
    o = torch.stack([x.double() for x in outs])            # (S, b, s, h, d)
    l = torch.stack([x.double() for x in lses])            # (S, b, h, s)
    b, s, h, d = outs[0].shape
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    lse = torch.zeros(b, h, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for si in range(s):
                ls = l[:, bi, hi, si]
                if torch.isnan(ls).any():
                    out[bi, si, hi] = math.nan
                    lse[bi, hi, si] = math.nan
                    continue
                seen = ls != math.inf
                if not seen.any():
                    lse[bi, hi, si] = math.inf
                    continue
                total = torch.logsumexp(ls[seen], 0)
                lse[bi, hi, si] = total
                out[bi, si, hi] = (torch.exp(ls[seen] - total)[:, None] * o[seen, bi, si, hi]).sum(0)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_follows_the_combine_rule(dtype):
    b, s, h, d, parts = 2, 7, 3, 8, 4
    outs = [torch.randn(b, s, h, d).to(dtype) for _ in range(parts)]
    lses = [torch.randn(b, h, s) * 4 for _ in range(parts)]
    lses[1][0, 0, 0] = 80.0                       # a dominant partial: the others' weights underflow, no overflow
    for p in range(parts):                        # row (0, h=1, s=2): no partial saw a key
        lses[p][0, 1, 2] = math.inf
    lses[0][1, 2, 3] = math.inf                   # some partials empty
    lses[3][1, 2, 3] = math.inf
    lses[2][1, 0, 4] = math.nan                   # a NaN score in one partial
    lses[0][0, 2, 5] = math.nan                   # NaN in the first partial (the running LSE starts at -inf)
    outs[1][1, 6, 1, 3] = math.nan                # a NaN value row reaching one O column with finite weight
    for p in range(parts):                        # empty partials have O = 0 (the ops' contract)
        empty = torch.isinf(lses[p]).transpose(1, 2)  # (b, s, h)
        outs[p][empty] = 0

    acc_out = torch.zeros(b, s, h, d)
    acc_lse = torch.full((b, h, s), -math.inf)
    for o, l in zip(outs, lses):
        merge_partial_(acc_out, acc_lse, o, l)
    out, lse = finalize(acc_out, acc_lse, dtype)
    want_out, want_lse = combine_rule(outs, lses)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    assert torch.equal(torch.isnan(out), torch.isnan(want_out))
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and (lse[torch.isinf(lse)] > 0).all()
    assert (out[0, 2, 1] == 0).all()
    ok = ~torch.isnan(want_lse) & ~torch.isinf(want_lse)
    assert (lse.double() - want_lse)[ok].abs().max() < 1e-5
    fin = ~torch.isnan(want_out)
    # the merge runs in fp32 and rounds once to dtype; the partials were already in dtype
    ulp = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    assert (out.double() - want_out)[fin].abs().max() <= ulp * max(1.0, want_out[fin].abs().max().item())


def test_merge_order_does_not_matter_beyond_rounding():
    b, s, h, d = 1, 5, 2, 16
    outs = [torch.randn(b, s, h, d) for _ in range(3)]
    lses = [torch.randn(b, h, s) for _ in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1]):
        acc_out, acc_lse = torch.zeros(b, s, h, d), torch.full((b, h, s), -math.inf)
        for i in order:
            merge_partial_(acc_out, acc_lse, outs[i], lses[i])
        results.append((acc_out, acc_lse))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
