import csv
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import podsrl.tasks.data_files as data_files
from podsrl.errors import ConfigError, DataError
from podsrl.tasks.datasets import DatasetTask, extract_answer, extract_boxed, extract_gsm8k, prompt_uid
from podsrl.tasks.templates import build_prompt, prompt_formatter

ROWS = [{"q": f"What is {i} + {i}?", "sol": f"Double it.\n#### {2 * i:,}", "level": i % 3} for i in range(20)]
ROWS[7]["sol"] = "Double it: #### 1,234"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    "text,fmt,want",
    [
        ("She pays 3*4=12.\n#### 1,234", "gsm8k", "1234"),
        ("a #### 5 then #### 72 ", "gsm8k", "72"),
        ("no marker", "gsm8k", None),
        ("####   ", "gsm8k", None),
        ("so \\boxed{\\frac{1}{2}}.", "boxed", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{a{b{c}}d}", "boxed", "a{b{c}}d"),
        ("\\fbox{7}", "boxed", "7"),
        ("\\boxed{unclosed {x}", "boxed", None),
        ("nothing boxed", "boxed", None),
        ("#### 9", "auto", "9"),
        ("x \\boxed{\\sqrt{2}}", "auto", "\\sqrt{2}"),
        ("  42 ", "auto", "42"),
        ("  42 ", "raw", "42"),
    ],
)
def test_extract_answer(text, fmt, want):
    assert extract_answer(text, fmt) == want


def test_extractors_directly():
    assert extract_gsm8k("#### -3,000") == "-3000"
    assert extract_boxed("\\boxed{{}}") == "{}" and extract_boxed("\\boxed{ }") is None
    with pytest.raises(ValueError):
        extract_answer("x", "latex")


# ---------------------------------------------------------------- loaders and column mapping


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"), (write_csv, "csv"), (write_parquet, "parquet")])
def test_loaders_and_column_mapping(tmp_path, writer, suffix):
    path = writer(tmp_path / f"data.{suffix}", ROWS)
    task = DatasetTask(str(path), prompt_column="q", answer_column="sol", answer_format="gsm8k",
                       format_prompt=lambda q: f"Q: {q}\nA:")
    assert len(task) == 20 and task.eval_set() == []
    by_q = {p.prompt: p for p in task.train_problems}
    p3 = by_q["Q: What is 3 + 3?\nA:"]
    assert p3.answer == "6"
    assert p3.uid == hashlib.sha1(b"What is 3 + 3?").hexdigest()[:16] == prompt_uid("What is 3 + 3?")
    assert set(p3.metadata) == {"level"}
    assert str(p3.metadata["level"]) == "0"  # csv gives text, the others keep the int
    assert task.train_problems[7].answer == "1234"


def test_json_array_and_auto_columns(tmp_path):
    rows = [{"question": "1+1?", "answer": 2, "id": "a"}, {"question": "2+2?", "answer": "#### 4", "id": "b"}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    task = DatasetTask(str(path), id_column="id")
    assert [(p.uid, p.prompt, p.answer, p.metadata) for p in task.train_problems] == [
        ("a", "1+1?", "2", {}), ("b", "2+2?", "4", {})]


# ---------------------------------------------------------------- order and splits


def test_epoch_permutations_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = DatasetTask(str(path), prompt_column="q", answer_column="sol", seed=3)
    b = DatasetTask(str(path), prompt_column="q", answer_column="sol", seed=3)
    c = DatasetTask(str(path), prompt_column="q", answer_column="sol", seed=4)
    epoch0 = [a.problem(i).uid for i in range(20)]
    epoch1 = [a.problem(i).uid for i in range(20, 40)]
    all_uids = sorted(p.uid for p in a.train_problems)
    assert sorted(epoch0) == all_uids and sorted(epoch1) == all_uids  # each epoch visits every row once
    assert epoch0 != epoch1
    assert [b.problem(i).uid for i in reversed(range(40))] == (epoch0 + epoch1)[::-1]  # random access
    assert [c.problem(i).uid for i in range(20)] != epoch0
    perm = a.permutation(5)
    assert [a.problem(100 + i).uid for i in range(20)] == [a.train_problems[int(j)].uid for j in perm]


def test_held_out_fraction(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    kw = {"prompt_column": "q", "answer_column": "sol", "eval_fraction": 0.25}
    a = DatasetTask(str(path), seed=1, **kw)
    b = DatasetTask(str(path), seed=1, **kw)
    c = DatasetTask(str(path), seed=2, **kw)
    ev, tr = {p.uid for p in a.eval_set()}, {p.uid for p in a.train_problems}
    assert len(ev) == 5 and len(tr) == 15 and not ev & tr
    assert ev | tr == {prompt_uid(r["q"]) for r in ROWS}
    assert [p.uid for p in b.eval_set()] == [p.uid for p in a.eval_set()]
    assert {p.uid for p in c.eval_set()} != ev
    assert len(DatasetTask(str(path), seed=1, eval_limit=2, **kw).eval_set()) == 2


def test_eval_split_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[10:])
    task = DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_split=str(test))
    assert len(task) == 10 and [p.answer for p in task.eval_set()] == [str(2 * i) for i in range(10, 20)]
    with pytest.raises(DataError, match="eval_split 'test'"):
        DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_split="test")


def test_eval_path_file_counts_what_is_used(tmp_path, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    other = write_parquet(tmp_path / "other.parquet", ROWS[10:])  # another file, another format
    with caplog.at_level("INFO", logger="podsrl"):
        task = DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path=str(other), eval_limit=4)
    assert len(task) == 10 and [p.answer for p in task.eval_set()] == [str(2 * i) for i in range(10, 14)]
    assert "evaluating on 4 of the 10 eval problems of " + str(other) + " (task.eval_size=4)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="podsrl"):
        task = DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path=str(other), eval_limit=50)
    assert len(task.eval_set()) == 10
    assert "evaluating on 10 of the 10 eval problems" in caplog.text and "more than there are" in caplog.text


def test_eval_path_hub_dataset_uses_its_split_and_config(tmp_path, monkeypatch):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    calls = []

    def fake_hub(name, config, split):
        calls.append((name, config, split))
        return iter([(f"split {split!r} row {i}", r) for i, r in enumerate(ROWS[15:])])

    monkeypatch.setattr(data_files, "_read_hub", fake_hub)
    task = DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path="org/other-set",
                       eval_split="validation", eval_config="main")
    assert calls == [("org/other-set", "main", "validation")] and len(task.eval_set()) == 5
    DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path="org/other-set")
    assert calls[-1] == ("org/other-set", None, "test")  # the split defaults to "test"


def test_eval_path_errors_name_the_field(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    with pytest.raises(DataError, match=r"^task\.args\.eval_path: .*missing\.jsonl: file not found"):
        DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a", "sol": "#### 1"}\n{"q": \n')
    with pytest.raises(DataError, match=r"^task\.args\.eval_path: .*bad\.jsonl: line 2 is not valid JSON"):
        DatasetTask(str(train), prompt_column="q", answer_column="sol", eval_path=str(bad))
    with pytest.raises(DataError, match="eval_path or eval_fraction"):
        DatasetTask(str(train), eval_path=str(bad), eval_fraction=0.1)


# ---------------------------------------------------------------- bad input


def test_bad_inputs(tmp_path):
    def make(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return str(p)

    cases = [
        (make("missing.jsonl", b'{"q": "a", "sol": "1"}\n{"q": "b"}\n'), r"missing\.jsonl: line 2: no column 'sol'"),
        (make("empty.jsonl", b""), r"empty\.jsonl: file is empty"),
        (make("blank.jsonl", b"\n\n"), r"blank\.jsonl: no rows"),
        (make("latin.jsonl", b'{"q": "a", "sol": "1"}\n{"q": "caf\xe9", "sol": "1"}\n'),
         r"latin\.jsonl: line 2 is not valid UTF-8"),
        (make("huge.jsonl", b'{"q": "a", "sol": "1"}\n{"q": "' + b"x" * 500 + b'", "sol": "1"}\n'),
         r"huge\.jsonl: line 2 is longer than 100 bytes"),
        (make("type.jsonl", b'{"q": "a", "sol": "1"}\n{"q": "b", "sol": [1, 2]}\n'),
         r"type\.jsonl: line 2: column 'sol' must be text or a number, got list"),
        (make("qtype.jsonl", b'{"q": 5, "sol": "1"}\n'), r"qtype\.jsonl: line 1: column 'q' must be non-empty"),
        (make("badjson.jsonl", b'{"q": "a", "sol": "1"}\n{"q": \n'), r"badjson\.jsonl: line 2 is not valid JSON"),
        (make("list.jsonl", b'[1, 2]\n'), r"list\.jsonl: line 1 is a JSON list"),
        (make("noans.jsonl", b'{"q": "a", "sol": "#### 1"}\n{"q": "b", "sol": "x"}\n'),
         r"noans\.jsonl: line 2: no answer found in column 'sol' with answer_format 'gsm8k'"),
        (make("bad.csv", b"q,sol\na,1\nb,2,3\n"), r"bad\.csv: line 3 has more fields"),
        (make("latin.csv", b"q,sol\ncaf\xe9,1\n"), r"latin\.csv: not valid UTF-8"),
        (make("huge.csv", b"q,sol\n" + b"y" * 500 + b",1\n"), r"huge\.csv: line 2: field larger"),
        (make("bad.parquet", b"not parquet"), r"bad\.parquet: cannot read as parquet"),
        (make("data.txt", b"hello"), r"data\.txt: unknown file type"),
        (str(tmp_path / "nope.jsonl"), r"nope\.jsonl: file not found"),
        (str(tmp_path), r"is a directory"),
    ]
    limit = csv.field_size_limit()
    for path, match in cases:
        fmt = "gsm8k" if "noans" in path else "raw"
        with pytest.raises(DataError, match=match):
            DatasetTask(path, prompt_column="q", answer_column="sol", answer_format=fmt, max_line_bytes=100)
    assert csv.field_size_limit() == limit  # process-wide: importlib.metadata reads RECORD files with it


def test_no_prompt_column_found(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "answer": "1"}])
    with pytest.raises(DataError, match="no prompt column found"):
        DatasetTask(str(path))


def test_hub_unreachable_message(monkeypatch):
    monkeypatch.setattr(data_files, "_hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(DataError, match="dataset 'podsrl-no-such/dataset-xyz': not found locally and the hub is "
                                        "unreachable"):
        DatasetTask("podsrl-no-such/dataset-xyz")


# ---------------------------------------------------------------- prompt templates

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "<u>{{ m['content'] }}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def tokenizer(chat_template):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=chat_template)


def test_build_prompt_chat_and_plain():
    tok = tokenizer(CHATML)
    assert build_prompt("2+2?", tok) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert build_prompt("2+2?", tok, system_prompt="Think.", template="Q: {question}") == (
        "<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\nQ: 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # a template that rejects a system turn gets the system prompt folded into the user turn
    assert build_prompt("x", tokenizer(NO_SYSTEM), system_prompt="S") == "<u>S\n\nx</u><a>"
    assert build_prompt("2+2?", None, mode="plain", template="Question: {question}\nAnswer:") == (
        "Question: 2+2?\nAnswer:")
    assert build_prompt("q", None, mode="plain", system_prompt="S") == "S\n\nq"
    assert build_prompt("{x}", None, mode="plain") == "{x}"  # braces in the question are text


def test_prompt_errors():
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        prompt_formatter(tokenizer(None), mode="chat")
    with pytest.raises(ConfigError, match=r"must contain \{question\} and no other fields, found \['answer'\]"):
        prompt_formatter(None, mode="plain", template="{question} {answer}")
    with pytest.raises(ConfigError, match="must contain"):
        build_prompt("q", None, mode="plain", template="no field")
    with pytest.raises(ConfigError, match="literal braces"):
        build_prompt("q", None, mode="plain", template="{question} {")
    with pytest.raises(ConfigError, match="prompt_mode"):
        prompt_formatter(None, mode="completion")


def test_dataset_with_chat_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    task = DatasetTask(str(path), prompt_column="q", answer_column="sol",
                       format_prompt=prompt_formatter(tokenizer(CHATML), "chat"))
    assert task.train_problems[0].prompt == (
        "<|im_start|>user\nWhat is 0 + 0?<|im_end|>\n<|im_start|>assistant\n")
    assert task.train_problems[0].uid == prompt_uid("What is 0 + 0?")  # uid from the question, not the template
