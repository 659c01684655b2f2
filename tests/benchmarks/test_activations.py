"""``python -m benchmarks.activations`` on a tiny workload: one line per family and dtype in the
documented format; bf16 keeps half of fp32's bytes; the lean block keeps no more than the textbook reference, nor the
analytic minimum more than the reference."""

import re

from benchmarks import activations

LINE = re.compile(r"^(\w+) (fp32|bf16): dfm (\d+\.\d), reference (\d+\.\d|—), analytic (\d+\.\d)$")


def test_tiny_dit_adaln_run_prints_the_line_format(capsys):
    tiny = ["--hidden", "32", "--samples", "2", "--video", "1", "4", "4", "--text", "4"]
    activations.main([*tiny, "--family", "dit_adaln"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [LINE.match(line) for line in lines]
    assert all(rows) and [m[2] for m in rows] == ["fp32", "bf16"], lines
    fp32, bf16 = ([float(m[i]) for i in (3, 4, 5)] for m in rows)
    assert all(abs(b / f - 0.5) < 0.02 for f, b in zip(fp32, bf16)), (fp32, bf16)
    dfm, reference, analytic = fp32
    assert dfm <= reference and analytic <= reference, fp32
