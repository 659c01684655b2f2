"""``python -m benchmarks.activations`` on a tiny workload: one line per family and dtype in the
documented format; bf16 keeps half of fp32's bytes; the lean block keeps no more than the textbook
reference, nor the analytic minimum more than the reference; FLUX's single-stream block is a row of its
own."""

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


def test_tiny_flux_single_stream_block_is_its_own_row(capsys):
    """One single-stream block (one more of them, per joint token): at most the analytic minimum, and
    ``--recompute-activation`` drops exactly the activation output (f = 4 h values per token, fp32)."""
    tiny = ["--hidden", "64", "--samples", "2", "--video", "1", "4", "4", "--text", "4", "--dtype", "fp32"]
    counts = []
    for extra in ([], ["--recompute-activation"]):
        activations.main([*tiny, "--family", "flux_single", *extra])
        (line,) = capsys.readouterr().out.strip().splitlines()
        row = LINE.match(line)
        assert row and row[1] == "flux_single", line
        counts.append((float(row[3]), float(row[5])))
    (plain, analytic), (recompute, _) = counts
    assert plain <= analytic, counts
    assert abs(plain - recompute - 4 * 4) < 0.05, counts
