"""Dataset loading and the prompt source: bad files fail at load time with the file, row and field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slipstream.agents.data import DatasetError, PromptSource, load_samples
from slipstream.agents.datagen import main as datagen_main
from slipstream.agents.datagen import make_rows
from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_data

GOOD = {
    "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
    "data_source": "arithmetic",
    "reward_model": {"style": "rule", "ground_truth": "3"},
    "extra_info": {"index": 0},
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loads_parquet_and_jsonl_alike(tmp_path):
    rows = make_rows("arithmetic", 5, seed=1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "a.jsonl", rows)
    from_parquet = load_samples([tmp_path / "a.parquet"])
    from_jsonl = load_samples([tmp_path / "a.jsonl"])
    assert from_parquet == from_jsonl
    assert [s.index for s in from_parquet] == list(range(5))
    assert from_parquet[0].messages[0]["role"] == "user"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"prompt": None}, "`prompt` is missing"),
        ({"prompt": "What is 1 + 2?"}, "`prompt` must be a non-empty list"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, "`prompt[0].role`"),
        ({"prompt": [{"role": "user", "content": 5}]}, "`prompt[0].content`"),
        ({"data_source": ""}, "`data_source`"),
        ({"reward_model": {"style": "rule"}}, "`reward_model.ground_truth` is missing"),
        ({"reward_model": "3"}, "`reward_model` must be a mapping"),
        ({"extra_info": [1, 2]}, "`extra_info` must be a mapping"),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path, change, field):
    bad = {**GOOD, **change}
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DatasetError) as err:
        load_samples([path])
    assert str(path) in str(err.value) and "row 2" in str(err.value) and field in str(err.value)


def test_bad_parquet_row_and_unreadable_files(tmp_path):
    bad = {**GOOD, "reward_model": {"style": "rule", "ground_truth": None}}
    pq.write_table(pa.Table.from_pylist([GOOD, bad]), tmp_path / "x.parquet")
    with pytest.raises(DatasetError, match=r"x\.parquet: row 1: field `reward_model.ground_truth`"):
        load_samples([tmp_path / "x.parquet"])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        load_samples([tmp_path / "junk.parquet"])
    (tmp_path / "broken.jsonl").write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(DatasetError, match=r"row 1 \(line 2\): not JSON"):
        load_samples([tmp_path / "broken.jsonl"])
    with pytest.raises(DatasetError, match="missing.jsonl: does not exist"):
        load_samples([tmp_path / "missing.jsonl"])
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_samples([write_jsonl(tmp_path / "a.csv", [GOOD])])


def test_a_directory_is_not_a_dataset_file(tmp_path):
    with pytest.raises(DatasetError, match="is a directory, not a data file"):
        load_samples([tmp_path])


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_check_data_says_a_directory_is_a_directory(tmp_path, key):
    good = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 4)
    (tmp_path / "prompts").mkdir()
    files = {"data.train_files": [good], "data.val_files": []}
    files[key] = [*files[key], tmp_path / "prompts"]
    cfg = load_config(None, [f"{k}=[{', '.join(map(str, v))}]" for k, v in files.items()])
    with pytest.raises(ConfigError) as err:
        check_data(cfg)
    message = str(err.value)
    assert message.startswith(f"{key}: {tmp_path / 'prompts'} is a directory, not a data file")
    assert "does not exist" not in message


def test_check_data_names_a_missing_validation_file(tmp_path):
    good = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 4)
    cfg = load_config(None, [f"data.train_files=[{good}]", f"data.val_files=[{tmp_path / 'val.jsonl'}]"])
    with pytest.raises(ConfigError, match=r"^data\.val_files: .*val\.jsonl does not exist$"):
        check_data(cfg)


def test_prompt_source_epochs_shuffle_and_resume(tmp_path):
    samples = load_samples([write_jsonl(tmp_path / "d.jsonl", [GOOD] * 7)])
    source = PromptSource(samples, shuffle=True, epochs=3, seed=5)
    served = []
    while (item := source.next()) is not None:
        served.append((item[0].epoch, item[0].index))
        if len(served) == 10:
            state = source.state_dict()
    assert len(served) == 21 and source.served == 21
    for epoch in range(3):  # each epoch is a permutation of all rows
        assert sorted(i for e, i in served if e == epoch) == list(range(7))
    assert [i for e, i in served if e == 0] != [i for e, i in served if e == 1]  # reshuffled per epoch

    resumed = PromptSource(samples, shuffle=True, epochs=3, seed=5)
    resumed.load_state_dict(state)
    rest = []
    while (item := resumed.next()) is not None:
        rest.append((item[0].epoch, item[0].index))
    assert rest == served[10:]

    with pytest.raises(ValueError, match="different order"):
        PromptSource(samples, shuffle=True, epochs=3, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset of 7 rows"):
        PromptSource(samples[:3], shuffle=True, epochs=3, seed=5).load_state_dict(state)


def test_data_make_cli_writes_loadable_datasets(tmp_path, capsys):
    assert datagen_main(["arithmetic", "--n", "20", "--out", str(tmp_path / "a.parquet"), "--seed", "3"]) == 0
    assert datagen_main(["countdown", "--n", "10", "--out", str(tmp_path / "c.jsonl")]) == 0
    arith = load_samples([tmp_path / "a.parquet"])
    assert len(arith) == 20
    for s in arith:
        a, b = s.extra_info["a"], s.extra_info["b"]
        assert 1 <= a <= 20 and 1 <= b <= 20 and s.ground_truth == str(a + b)
        assert s.messages[0]["content"] == f"What is {a} + {b}? Reply with only the number."
    assert make_rows("arithmetic", 20, seed=3) == make_rows("arithmetic", 20, seed=3)
    countdown = load_samples([tmp_path / "c.jsonl"])
    assert {s.data_source for s in countdown} == {"countdown"}
    assert datagen_main(["arithmetic", "--n", "2", "--out", str(tmp_path / "a.txt")]) == 2
    assert "unknown output format" in capsys.readouterr().err
