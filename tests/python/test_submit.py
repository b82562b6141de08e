"""Client.submit against a real learner: the learner's own rules and messages (derived by
submitting the same bytes with the C++ `grpo submit`), grpo submit's idempotency key, every kind
of source, whole-or-nothing uploads that survive a dropped connection, auth and TLS."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tqdm import tqdm

import grpo_serve
from grpo_serve.dataset import content_key, split_jsonl, validate_lines
from tcp_proxy import TcpProxy

GOOD = b'{"prompt": "good"}'

# One line each, submitted after GOOD (so a refused one is "dataset line 2"). The learner decides
# which are taken and with what message; the test only lists bytes.
LINES: list[bytes] = [
    # taken
    b'{"prompt": "plain", "answer": 3}',
    b'\xef\xbb\xbf{"prompt": "a BOM"}',
    b'{"prompt": "form feed after"}\f',
    b'\v{"prompt": "vertical tab before"}',
    b'{"prompt": "a NUL, then anything"} \x00 garbage',
    b'{"prompt": "crlf"}\r',
    b'{"prompt": "big int", "n": 123456789012345678901234567890}',
    b'{"prompt": "underflow", "n": 1e-400}',
    b'{"prompt": "\\ud83d\\ude00 a pair"}',
    b'{"prompt": "p", "messages": [{"role": "user", "content": "both"}]}',
    b'{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "u"},'
    b' {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]}',
    b'{"prompt": "nested", "meta": {"a": [1, 2, {"b": null}]}}',
    '{"prompt": "h\u00e9llo \u65e5\u672c"}'.encode(),
    b'{"prompt": "a budget of its own", "max_completion_length": 4}',
    b'{"prompt": "a budget over the job\'s", "max_completion_length": 100000}',
    # refused
    b'[1, 2]',
    b'"a string"',
    b'42',
    b'null',
    b'{"question": "neither key"}',
    b'{"prompt": ""}',
    b'{"prompt": 5}',
    b'{"prompt": null}',
    b'{"prompt": [{"role": "user", "content": "TRL conversational"}]}',
    b'{"prompt": "a", "prompt": ""}',
    b'{"messages": "hi"}',
    b'{"messages": []}',
    b'{"messages": ["hi"]}',
    b'{"messages": [{"content": "no role"}]}',
    b'{"messages": [{"role": "", "content": "x"}]}',
    b'{"messages": [{"role": 1, "content": "x"}]}',
    b'{"messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "user", "content": null}]}',
    b'{"messages": [{"role": "bot", "content": "x"}]}',
    b'{"messages": [{"role": "bot", "content": "x"}, {"role": "user"}]}',
    b'{"prompt": "ok", "messages": [{"role": "narrator", "content": "x"}]}',
    b'{"prompt": "ok", "messages": {}}',
    b'{"prompt": "x", "max_completion_length": 0}',
    b'{"prompt": "x", "max_completion_length": -3}',
    b'{"prompt": "x", "max_completion_length": 2.5}',
    b'{"prompt": "x", "max_completion_length": 8.0}',
    b'{"prompt": "x", "max_completion_length": "8"}',
    b'{"prompt": "x", "max_completion_length": true}',
    b'{"prompt": "x", "max_completion_length": null}',
    b'{"prompt": "x", "max_completion_length": 9223372036854775808}',
    b'{"prompt": "x", "max_completion_length": 123456789012345678901234567890}',
    # not JSON
    b'{"prompt": "x"',
    b'{"prompt": "x", "n": NaN}',
    b'{"prompt": "x", "n": Infinity}',
    b'{"prompt": "x", "n": 1e400}',
    b'{"prompt": "x", "n": -1e400}',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\udc00x"}',
    b'{"prompt": "a\xff"}',
    b'{"prompt": "\xed\xa0\x80"}',
    b'{"prompt": "x"}{"a": 1}',
    b'\xef\xbb{"prompt": "half a BOM"}',
    b"{'prompt': 'single quotes'}",
    b'{"prompt": "x",}',
    b'\x00{"prompt": "x"}',
]


def grpo_submit(learner: Any, path: Path, *args: str) -> tuple[int, str, dict[str, Any] | None]:
    """(exit code, the learner's message or "", the --json reply) of the C++ client."""
    r = learner.grpo("submit", "--dataset", str(path), "--json", *args)
    reply = json.loads(r.stdout) if r.returncode == 0 else None
    m = re.match(r"grpo submit: [A-Z_]+: (.*)", r.stderr.strip(), re.S)
    return r.returncode, (m.group(1) if m else r.stderr.strip()), reply


def learner_verdict(client: grpo_serve.Client, path: Path) -> tuple[int | None, str]:
    """What the learner itself says of a file's lines, sent unchecked (validate=False): the
    lines as grpo submit sends them (test_the_default_key_is_grpo_submits holds the two uploads
    to the same bytes), the verdict and message the learner's."""
    try:
        job = client.submit(path, validate=False, idempotency_key=f"verdict-{path.name}",
                            progress=False)
        return job.prompt_count, ""
    except grpo_serve.RpcError as e:
        assert e.code == "INVALID_ARGUMENT", e
        return None, e.details


def python_verdict(data: bytes) -> tuple[int | None, str]:
    try:
        return validate_lines(split_jsonl(data)), ""
    except grpo_serve.DatasetError as e:
        return None, str(e)


def assert_same_verdict(line: bytes, learner: tuple[int | None, str],
                        python: tuple[int | None, str]) -> None:
    (want_count, message), (count, why) = learner, python
    if want_count is not None:
        assert count == want_count, f"Python refuses {line!r} ({why}); the learner takes it"
        return
    assert count is None, f"Python takes {line!r}; the learner says: {message}"
    if "not valid JSON (" in message:
        # The parenthesis holds the parser's own words: nlohmann's there, Python's here.
        prefix = message[: message.index("not valid JSON (") + len("not valid JSON (")]
        assert why.startswith(prefix), (line, why, message)
    else:
        assert why == message, line


@pytest.fixture(scope="module")
def learner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A learner without workers: datasets are stored, nothing trains."""
    from conftest import Learner

    lr = Learner(tmp_path_factory.mktemp("submit"), "--reward_funcs", "length")
    yield lr
    lr.stop()


def test_every_line_is_judged_as_the_learner_judges_it(learner: Any, tmp_path: Path) -> None:
    taken = 0
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        for i, line in enumerate(LINES):
            data = GOOD + b"\n" + line + b"\n"
            path = tmp_path / f"case{i}.jsonl"
            path.write_bytes(data)
            verdict = learner_verdict(client, path)
            assert_same_verdict(line, verdict, python_verdict(data))
            taken += verdict[0] is not None
    assert 12 <= taken <= len(LINES) - 30  # both kinds really ran


def test_grpo_submit_gets_the_same_verdicts(learner: Any, tmp_path: Path) -> None:
    # The C++ client itself, on a few of the lines (each run starts a process that loads
    # libtorch, about a second).
    for i in (4, 21, 38):
        data = GOOD + b"\n" + LINES[i] + b"\n"
        path = tmp_path / f"cli{i}.jsonl"
        path.write_bytes(data)
        rc, message, reply = grpo_submit(learner, path)
        verdict = (reply["prompt_count"] if reply else None, message)
        assert rc == (0 if reply else 2), message
        assert_same_verdict(LINES[i], verdict, python_verdict(data))


@pytest.mark.parametrize("data", [b"", b"\n", b"  \n\t\n", b"\xef\xbb\xbf\n"])
def test_no_prompts_is_the_learners_error(learner: Any, tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(data)
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        verdict = learner_verdict(client, path)
    assert verdict[0] is None
    assert_same_verdict(data, verdict, python_verdict(data))


def test_the_default_key_is_grpo_submits(learner: Any, tmp_path: Path) -> None:
    # CRLF endings, a blank line and no final newline: the key covers the bytes as sent.
    data = b'{"prompt": "k1"}\r\n\r\n\xef\xbb\xbf{"prompt": "k2", "x": 1}\r\n{"prompt": "k3"}'
    path = tmp_path / "keyed.jsonl"
    path.write_bytes(data)
    rc, message, reply = grpo_submit(learner, path)
    assert rc == 0, message
    assert reply is not None and reply["created"] is True
    with learner.ledger() as db:
        (stored_key,) = db.execute("SELECT idempotency_key FROM datasets WHERE id = ?",
                                   (reply["dataset_id"],)).fetchone()
    assert content_key(split_jsonl(data)) == stored_key
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        job = client.submit(path)
    assert (job.dataset_id, job.prompt_count, job.created) == (reply["dataset_id"], 3, False)
    assert job.idempotency_key == stored_key


def test_resubmitting_rows_adds_nothing(learner: Any) -> None:
    rows = [{"prompt": f"again {i}", "answer": i} for i in range(5)]
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        first = client.submit(rows, name="again")
        second = client.submit([dict(r) for r in rows])
    assert first.created and not second.created
    assert (second.dataset_id, second.prompt_count) == (first.dataset_id, 5)
    with learner.ledger() as db:
        n = db.execute("SELECT COUNT(*) FROM prompts WHERE dataset_id = ?",
                       (first.dataset_id,)).fetchone()[0]
    assert n == 5


def test_a_key_used_for_other_rows_is_the_learners_error(learner: Any, tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b'{"prompt": "first rows"}\n')
    b.write_bytes(b'{"prompt": "other rows"}\n')
    assert grpo_submit(learner, a, "--idempotency_key", "shared-key")[0] == 0
    rc, message, _ = grpo_submit(learner, b, "--idempotency_key", "shared-key")
    assert rc != 0 and "already used" in message
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        with pytest.raises(grpo_serve.RpcError) as e:
            client.submit(b, idempotency_key="shared-key")
    assert e.value.code == "ALREADY_EXISTS"
    assert e.value.details == message


def test_unvalidated_rows_meet_the_same_message_at_the_learner(learner: Any) -> None:
    rows = [{"prompt": "fine"}, {"messages": [{"role": "user", "content": "x"}]},
            {"messages": [{"role": "judge", "content": "x"}]}]
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        with pytest.raises(grpo_serve.DatasetError) as local:
            client.submit(rows)
        with pytest.raises(grpo_serve.RpcError) as remote:
            client.submit(rows, validate=False)
    assert remote.value.code == "INVALID_ARGUMENT"
    assert remote.value.details == str(local.value)
    assert str(local.value).startswith("dataset line 3: chat message 0 has role 'judge'")


def test_a_row_that_is_not_json_is_refused_before_sending(learner: Any) -> None:
    with learner.ledger() as db:
        before = db.execute("SELECT COUNT(*) FROM datasets").fetchone()[0]
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        with pytest.raises(grpo_serve.DatasetError, match=r"^dataset line 2: not valid JSON"):
            client.submit([{"prompt": "a"}, {"prompt": "b", "score": float("nan")}])
        with pytest.raises(grpo_serve.DatasetError, match=r"dataset line 1: .*set"):
            client.submit([{"prompt": "a", "tags": {1, 2}}])
    with learner.ledger() as db:
        assert db.execute("SELECT COUNT(*) FROM datasets").fetchone()[0] == before


def stored_rows(learner: Any, dataset_id: str) -> list[Any]:
    with learner.ledger() as db:
        rows = db.execute("SELECT id, row_json FROM prompts WHERE dataset_id = ?",
                          (dataset_id,)).fetchall()
    rows.sort(key=lambda r: int(r[0].rsplit(":", 1)[1]))
    return [json.loads(r[1]) for r in rows]


ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "difficulty": 1},
    {"prompt": "Name a colour.", "answer": "red", "difficulty": 2},
    {"prompt": "Say h\u00e9llo.", "answer": "h\u00e9llo", "difficulty": 3},
]


def test_every_source_stores_its_rows(learner: Any, tmp_path: Path) -> None:
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:1])})
    sources: list[tuple[str, Any, dict[str, Any], list[Any]]] = [
        ("list", ROWS, {}, ROWS),
        ("Dataset", datasets.Dataset.from_list(ROWS), {}, ROWS),
        ("DatasetDict split", dd, {"split": "test"}, ROWS[:1]),
        ("JSON Lines", jsonl, {}, ROWS),
        ("JSON Lines (str)", str(jsonl), {}, ROWS),
        ("parquet", parquet, {}, ROWS),
        ("generator", (dict(r, gen=True) for r in ROWS), {}, [dict(r, gen=True) for r in ROWS]),
    ]
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        for what, source, kwargs, want in sources:
            job = client.submit(source, idempotency_key=f"source-{what}", **kwargs)
            assert job.created, what
            assert job.prompt_count == len(want), what
            assert stored_rows(learner, job.dataset_id) == want, what


def test_a_dataset_mixing_prompt_and_messages_keeps_working(learner: Any) -> None:
    # Arrow gives each row the other rows' columns as null.
    ds = datasets.Dataset.from_dict({
        "prompt": ["plain text", None], "answer": ["a", None],
        "messages": [None, [{"role": "user", "content": "chat"}]]})
    assert ds[0]["messages"] is None and ds[1]["prompt"] is None
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        job = client.submit(ds)
    assert stored_rows(learner, job.dataset_id) == [
        {"prompt": "plain text", "answer": "a"},
        {"messages": [{"role": "user", "content": "chat"}], "answer": None}]


def test_a_dataset_dict_needs_a_split(learner: Any) -> None:
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "validation": datasets.Dataset.from_list(ROWS)})
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        with pytest.raises(grpo_serve.DatasetError, match=r"splits: train, validation"):
            client.submit(dd)
        with pytest.raises(grpo_serve.DatasetError, match=r"no split 'test'"):
            client.submit(dd, split="test")
        assert client.submit(dd["validation"]).prompt_count == 3


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "one row"}, "single dict"),
    (42, "cannot read a dataset from a int"),
    ("no-such-file.jsonl", "cannot read no-such-file.jsonl"),
    ("rows.csv", "not a JSON Lines"),
])
def test_what_is_no_dataset_is_named(learner: Any, bad: Any, match: str) -> None:
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        with pytest.raises(grpo_serve.DatasetError, match=match):
            client.submit(bad)


def big_rows(n: int = 3000) -> list[dict[str, Any]]:
    return [{"prompt": f"row {i} " + "x" * 1000} for i in range(n)]  # ~3 MiB


def test_an_upload_cut_midway_stores_nothing_and_its_retry_stores_it_once(learner: Any) -> None:
    rows = big_rows()
    key = content_key(grpo_serve.to_lines(rows).lines)
    with learner.ledger() as db:
        before = db.execute("SELECT COUNT(*) FROM datasets").fetchone()[0]
    proxy = TcpProxy(learner.address, cut_first_after_bytes=1 << 20)
    try:
        with grpo_serve.Client(proxy.address, token=learner.token) as client:
            job = client.submit(rows, progress=False)
    finally:
        proxy.close()
    assert proxy.cuts == 1 and proxy.accepted >= 2  # the first upload broke; a retry went through
    assert job.created and job.prompt_count == len(rows) and job.idempotency_key == key
    with learner.ledger() as db:
        assert db.execute("SELECT COUNT(*) FROM datasets").fetchone()[0] == before + 1
        assert db.execute("SELECT COUNT(*) FROM datasets WHERE idempotency_key = ?",
                          (key,)).fetchone()[0] == 1
    assert stored_rows(learner, job.dataset_id) == rows


def test_without_retries_a_cut_upload_is_an_error(learner: Any) -> None:
    proxy = TcpProxy(learner.address, cut_first_after_bytes=1 << 20)
    try:
        with grpo_serve.Client(proxy.address, token=learner.token) as client:
            with pytest.raises(grpo_serve.RpcError) as e:
                client.submit(big_rows(2500), retries=0, progress=False)
    finally:
        proxy.close()
    assert e.value.code in ("UNAVAILABLE", "ABORTED")


def test_a_large_upload_shows_a_progress_bar(learner: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rows = big_rows(5000)  # ~5 MiB: over PROGRESS_MIN_BYTES
    total = grpo_serve.to_lines(rows).total_bytes
    assert total >= grpo_serve.client.PROGRESS_MIN_BYTES
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        client.submit(rows)
        client.submit(rows[:10], idempotency_key="small")  # under the threshold: no bar
    err = capsys.readouterr().err
    size = tqdm.format_sizeof(total, divisor=1024)
    bars = [line for line in err.split("\n") if "upload:" in line]
    assert len(bars) == 1  # each bar ends its line; the small upload shows none
    assert "upload: 100%" in err and f"{size}/{size}" in err


def test_a_bad_or_missing_token_is_unauthenticated(learner: Any, tmp_path: Path) -> None:
    for token in ("wrong-token", None):
        with grpo_serve.Client(learner.address, token=token) as client:
            with pytest.raises(grpo_serve.RpcError) as e:
                client.status()
        assert e.value.code == "UNAUTHENTICATED"
    bad = tmp_path / "token"
    bad.write_bytes(b"abc\x01def\n")
    with pytest.raises(grpo_serve.GrpoServeError, match="byte 0x01 at offset 3"):
        grpo_serve.Client(learner.address, token_file=bad)


def test_tls_with_the_learners_ca(make_learner: Any, tmp_path: Path) -> None:
    key, cert = tmp_path / "learner.key", tmp_path / "learner.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    lr = make_learner("--reward_funcs", "length", "--tls_cert_file", str(cert),
                      "--tls_key_file", str(key))
    address = f"localhost:{lr.port}"
    with grpo_serve.Client(address, token=lr.token, tls_ca=cert) as client:
        assert client.status().state == "waiting_for_data"
    with grpo_serve.Client(address, token=lr.token, timeout=3) as plain:
        with pytest.raises(grpo_serve.RpcError) as e:
            plain.status()
    assert e.value.code == "UNAVAILABLE"
    notpem = tmp_path / "ca.txt"
    notpem.write_text("not a certificate")
    with pytest.raises(grpo_serve.GrpoServeError, match="holds no PEM block"):
        grpo_serve.Client(address, tls_ca=notpem)


def test_progress_can_be_forced(learner: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        client.submit([{"prompt": "tiny"}], progress=True, idempotency_key="forced-bar")
    assert "upload:" in capsys.readouterr().err


def test_submit_returns_a_job_handle(learner: Any) -> None:
    with grpo_serve.Client(learner.address, token=learner.token) as client:
        job = client.submit([{"prompt": "handle"}], name="handle")
        status = job.status()
    assert isinstance(status, grpo_serve.JobStatus) and job.client is client
    assert status.prompts.total >= 1 and status.state in ("waiting_for_data", "running")
