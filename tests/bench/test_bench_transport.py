"""`slipstream bench weightsync` runs end to end and ends with the JSON line docs/benchmarks.md records."""

from __future__ import annotations

import json

from slipstream.system.bench_transport import SMOLLM2_135M, main, model_shapes

KEYS = {
    "receivers",
    "bytes",
    "bucket_mb",
    "effective_gbps",
    "raw_gbps",
    "naive_gbps",
    "pause_s",
    "transfer_s",
}


def test_the_quickstart_model_shapes_come_from_its_config():
    shapes = dict(model_shapes(SMOLLM2_135M))
    assert len(shapes) == 272 and shapes["model.embed_tokens.weight"] == (49152, 576)
    assert sum(n for s in shapes.values() for n in [__import__("math").prod(s)]) == 134_515_008


def test_the_bench_prints_one_row_per_receiver_count(capsys):
    assert main(["--json", "--sets", "tiny-fp32", "--receivers", "1", "--reps", "1", "--bucket-mb", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert len(rows) == 1 and KEYS <= rows[0].keys()
    assert rows[0]["receivers"] == 1 and rows[0]["effective_gbps"] > 0 and rows[0]["raw_gbps"] > 0
