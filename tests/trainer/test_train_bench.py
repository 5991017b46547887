"""`slipstream bench train` runs end to end on a toy size and ends with the documented JSON line."""

from __future__ import annotations

import json

from slipstream.system import bench_train as bench


def test_bench_train_json_line(capsys, single_process_group):
    assert (
        bench.main(
            [
                "--json",
                "--samples",
                "4",
                "--group-size",
                "2",
                "--median",
                "4",
                "--max-len",
                "24",
                "--prompt-len",
                "4",
                "--steps",
                "1",
                "--micro-batch-tokens",
                "64",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    keys = {"packed_tok_s", "padded_tok_s", "speedup", "shared_tok_s", "shared_speedup", "real_tokens"}
    assert keys | {"padded_tokens"} <= set(result)
    assert result["padded_tokens"] >= result["real_tokens"] > 0
