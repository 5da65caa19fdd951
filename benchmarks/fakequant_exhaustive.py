"""A one-off check, not a benchmark: every positive fp32 below 2**(emax + 1) (and every 64th negative), in MX
blocks led by 2**emax so their E8M0 scale is 1, gives fake_quantize == quantize().dequantize() bit for bit (NaN as
NaN), round to nearest even, for each MX format named: `python benchmarks/fakequant_exhaustive.py mxfp8_e4m3 ...`
(about 3 min per format on one core; docs/results-history.md). The tests sweep the same grids densely instead."""
import sys, time, torch
from mixprec.blockscale import fake_quantize, quantize
from mixprec.formats import get_block_format
torch.set_num_threads(1)
CH = 31 * 2 ** 19
for name in sys.argv[1:]:
    fmt = get_block_format(name); e = fmt.element
    top = int(torch.tensor(float(2 ** (e.emax + 1))).view(torch.int32))
    lead = float(2 ** e.emax); bad = 0; n = 0; t0 = time.time()
    for start in range(0, top, CH):
        bits = torch.arange(start, min(start + CH, top), dtype=torch.int32)
        for sign in (1, -1):
            vals = bits.view(torch.float32) if sign == 1 else -bits[::64].view(torch.float32)
            pad = -vals.numel() % 31
            vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, 31)
            x = torch.cat([torch.full((vals.shape[0], 1), lead), vals], 1)
            f = fake_quantize(x, fmt); r = quantize(x, fmt).dequantize()
            nan = r.isnan()
            bad += int(((f.view(torch.int32) != r.view(torch.int32)) & ~nan).sum()) + int((f.isnan() != nan).sum())
            n += vals.numel()
    print(f"{name}: {n} values (all positive fp32 < 2**{e.emax + 1}, every 64th negative), {bad} differ, "
          f"{time.time() - t0:.0f} s", flush=True)
