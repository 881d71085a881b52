"""bench/compare_engines.py's parts on a tiny model: the ONNX export wrapper computes transformers' logits and
past keys/values, the worker protocol returns our generate's tokens, the streamed bytes per format, the token
agreement, the skip reasons, and bench.report's engines table. ONNX Runtime and llama.cpp themselves are optional
(bench/requirements.txt): their end-to-end test runs where they are installed."""
import importlib.util
import os
import statistics

import pytest
import torch
import transformers

from bench import compare_engines as ce
from bench import report
from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel

TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random transformers GPT-2, loaded by ours and written by our save_pretrained (as the bench does)."""
    folder = tmp_path_factory.mktemp("engines")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(GPT2Config(**TINY).to_hf())
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8)  # sharper logits than a fresh init: greedy tokens that vary
    hf.save_pretrained(folder / "hf")
    GPT2LMHeadModel.from_pretrained(folder / "hf").save_pretrained(folder / "model")
    return folder / "model", hf.eval()


def test_the_export_wrapper_computes_transformers_logits_and_cache(saved):
    model_dir, hf = saved
    graph, config = ce.OnnxGraph.module(model_dir)
    L, H, C = config["n_layer"], config["n_head"], config["n_embd"]
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    empty = [torch.zeros(1, H, 0, C // H) for _ in range(2 * L)]
    with torch.no_grad():
        logits, *present = graph(ids, torch.arange(5)[None], *empty)
        ref = hf(ids, use_cache=True)
        torch.testing.assert_close(logits[:, -1], ref.logits[:, -1], rtol=1e-5, atol=1e-5)
        assert [tuple(p.shape) for p in present] == [(1, H, 5, C // H)] * (2 * L)
        step, *_ = graph(torch.tensor([[7]]), torch.tensor([[5]]), *present)
        ref_step = hf(torch.tensor([[7]]), past_key_values=ref.past_key_values).logits
        torch.testing.assert_close(step[:, -1], ref_step[:, -1], rtol=1e-5, atol=1e-5)


def test_a_worker_returns_our_generate_tokens(saved):
    model_dir, _ = saved
    worker = ce.Worker("ours-fp32", model_dir, None, threads=1)
    try:
        answer = worker.ask({"task": "decode", "prompt": [5, 17, 3], "new": 6})
        prefill = worker.ask({"task": "prefill", "prompt": [5, 17, 3]})
    finally:
        worker.close()
    ours = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    expected = ours.generate(torch.tensor([[5, 17, 3]]), max_new_tokens=6)[0, 3:].tolist()
    assert answer["tokens"] == expected and answer["seconds"] > 0
    assert prefill["tokens"] == expected[:1]
    # the worker says what it runs (recorded with each row): torch's version and CPU capability, the kernel's state
    assert worker.build.startswith(f"torch {torch.__version__}, CPU capability ") and "rows kernel" in worker.build


def test_a_worker_collects_its_garbage_when_asked_and_decodes_after(saved):
    model_dir, _ = saved
    worker = ce.Worker("ours-fp32", model_dir, None, threads=1)
    try:
        first = worker.ask({"task": "collect"})
        second = worker.ask({"task": "collect"})
        answer = worker.ask({"task": "decode", "prompt": [5, 17, 3], "new": 2})
    finally:
        worker.close()
    assert second["full_collections"] == first["full_collections"] + 1 and first["seconds"] > 0  # a full one each
    assert len(answer["tokens"]) == 2


def test_a_call_with_its_own_environment_sets_it_for_that_call_only(saved, monkeypatch):
    """The thread choice's A/B: one worker's calls alternate between its own setting and GPT2_DECODE_THREADS=N set
    for the call; the variables are as before after each call (set ones restored, unset ones removed)."""
    monkeypatch.setenv("GPT2_PROMPT_THREADS", "auto")
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    with ce.environment({"GPT2_DECODE_THREADS": "1", "GPT2_PROMPT_THREADS": "1"}):
        assert os.environ["GPT2_DECODE_THREADS"] == os.environ["GPT2_PROMPT_THREADS"] == "1"
    assert "GPT2_DECODE_THREADS" not in os.environ and os.environ["GPT2_PROMPT_THREADS"] == "auto"
    asked = []

    class Fake:
        def ask(self, task):
            asked.append(task.get("env"))
            return {"seconds": 1.0 + len(asked)}
    times = ce.alternating(Fake(), {"task": "decode"}, {"GPT2_DECODE_THREADS": "2"}, 3)
    fixed = {"GPT2_DECODE_THREADS": "2"}
    assert asked == [None, fixed, fixed, None, None, fixed]  # the order swapped each round
    assert times == {"own": [2.0, 5.0, 6.0], "env": [3.0, 4.0, 7.0]}
    model_dir, _ = saved
    worker = ce.Worker("ours-fp32", model_dir, None, threads=1)
    try:  # a real worker answers such a call with the same tokens (one thread either way here)
        plain = worker.ask({"task": "decode", "prompt": [5, 17, 3], "new": 6})
        fixed_call = worker.ask({"task": "decode", "prompt": [5, 17, 3], "new": 6, "env": {"GPT2_DECODE_THREADS": "1"}})
    finally:
        worker.close()
    assert plain["tokens"] == fixed_call["tokens"]


def test_streamed_bytes_per_format(saved):
    model_dir, _ = saved
    C, V, L = 64, 101, 2
    matrices = V * C + L * (3 * C * C + C * C + 4 * C * C + 4 * C * C)  # the tied head once, no position table
    vectors = L * (2 * C + 3 * C + C + 4 * C + C + 2 * C) + 2 * C  # norms and biases
    assert ce.streamed_bytes("ours-fp32", None, model_dir) == 4 * (matrices + vectors)
    rows = V + L * (3 * C + C + 4 * C + C)  # one fp32 scale per output row of each matrix
    assert ce.streamed_bytes("ours-int8", None, model_dir) == matrices + 4 * rows + 4 * vectors
    assert ce.streamed_bytes("ours-int4", None, model_dir) == matrices // 2 + 4 * matrices // 32 + 4 * vectors


def test_agreement_names_where_the_tokens_part():
    assert ce.agreement([1, 2, 3], [1, 2, 3]) == "3/3 identical"
    assert ce.agreement([1, 2, 9, 4], [1, 2, 3, 4]) == "first 2 identical (3/4 positions equal)"


def test_a_missing_engine_is_skipped_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else real(name))
    assert "onnxruntime" in ce.missing("ort-fp32") and "bench/requirements.txt" in ce.missing("ort-int8")
    assert ce.missing("ours-fp32") is None


def _record(engine, kind, value, busy=0, load=1.0, **extra):
    return {"bench": "compare_engines", "row": f"{kind} {engine}", "values": {engine: value}, "unit": "x",
            "engine": engine, "kind": kind, "busy": busy, "share": 0.5, "tokens": "64/64 identical",
            "machine": {"cpu": "CPU X", "class": "AVX2", "cores": 2, "device": "cpu"}, "commit": "abc",
            "date": "2026-11-26T06:00Z", "load": load, "source": "run", **extra}


def test_the_engines_table_puts_quiet_busy_and_prefill_side_by_side():
    records = [_record("ours-fp32", "decode", 40.0), _record("ort-fp32", "decode", 50.0),
               _record("ours-fp32", "decode", 20.0, busy=1, load=3.5), _record("ort-fp32", "prefill", 1.2),
               _record("ours-fp32", "first-token", 0.025), _record("ort-fp32", "first-token", 0.0316),
               _record("ours-fp32", "decode", 10.0, load=6.0)]  # an older busy-load run of the quiet row
    text = report.render("engines class=AVX2", records)
    lines = text.splitlines()
    assert lines[0].startswith("| engine | format | tokens/s |")
    assert lines[2].startswith("| ours | fp32 | 40.0 |  | 50% | 1.00x | 64/64 identical | 20.0 (50% of quiet) | 25.0 |")
    assert lines[3].startswith("| ONNX Runtime | fp32 | 50.0 |  | 50% | 1.25x |") and lines[3].endswith("| 31.6 | 1.20 |")
    assert "; 1 busy" in text and "(no compare_engines records for AMX yet)" in report.render("engines class=AMX",
                                                                                                   records)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
                    reason="onnxruntime and onnx are optional (pip install -r bench/requirements.txt)")
def test_onnx_runtime_decodes_transformers_tokens(saved, tmp_path):
    model_dir, hf = saved
    paths = ce.export_onnx(model_dir, tmp_path)
    runner = ce.OnnxRuntime("ort-fp32", model_dir, paths["ort-fp32"], threads=1)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([[5, 17, 3]])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, 3:].tolist()
    assert runner.decode([5, 17, 3], 8) == expected
    assert runner.prefill([5, 17, 3]) == expected[0]


def test_the_engines_table_lists_engines_in_the_benchs_order_and_the_claims_per_class():
    records = [_record("ort-fp32", "decode", 50.0), _record("hf-fp32", "decode", 20.0),
               _record("ours-fp32", "decode", 40.0)]  # an older run had measured transformers first
    lines = report.render("engines class=AVX2", records).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| ours", "| transformers", "| ONNX Runtime"]
    busy = [_record("ours-fp32", "decode", 20.0, busy=1), _record("ort-fp32", "decode", 25.0, busy=1)]
    other = [{**r, "machine": {**r["machine"], "class": "AVX512-BF16"}} for r in records + busy]
    text, used = report._busy_claim(records + busy + other)
    assert text == ("fp32 20.0 tokens/s, 50% of quiet; 0.80x ONNX Runtime fp32 under the same load (AVX512-BF16); "
                    "fp32 20.0 tokens/s, 50% of quiet; 0.80x ONNX Runtime fp32 under the same load (AVX2)")
    assert len(used) == 6


def test_the_engines_table_gives_each_rows_range_over_rounds_and_names_the_fixed_thread_count():
    # 64 tokens in rounds of 1.0, 1.6 and 0.8 s: median 64 tokens/s; the rounds 40 and 80 tokens/s
    records = [_record("ours-fp32", "decode", 64.0, seconds=[1.0, 1.6, 0.8]),
               _record("ours-fp32-fixed", "decode", 50.0, threads=2)]
    lines = report.render("engines class=AVX2", records).splitlines()
    assert lines[2].startswith("| ours | fp32 | 64.0 | 40.0-80.0 | 50% |")
    assert lines[3].startswith("| ours | fp32, 2 threads every step | 50.0 |  |")


def _threads_record(ratio, busy):
    return {**_record("ours-fp32", "threads", 40.0, busy=busy), "ratio": ratio, "kind": "threads", "threads": 2}


def test_the_thread_choice_claim_gives_quiet_and_busy_ratios_per_class():
    text, used = report._threads_claim([_threads_record(0.99, 0), _threads_record(2.5, 1)])
    assert text == "AVX2: 0.99x quiet, 2.50x with a core busy (against 2 threads fixed)" and len(used) == 2
    assert report._threads_claim([_record("ours-fp32", "decode", 40.0)]) == ("", [])


def test_the_thread_choice_claim_adds_the_prompts_blocks_where_recorded():
    prompt = [{**_threads_record(ratio, busy), "kind": "prompt-threads", "tokens_in": 512}
              for ratio, busy in ((0.98, 0), (1.6, 1))]
    text, used = report._threads_claim([_threads_record(1.02, 0), _threads_record(1.5, 1), *prompt])
    assert text == ("AVX2: decode 1.02x quiet, 1.50x with a core busy; prompt 512 0.98x quiet, 1.60x with a core "
                    "busy (against 2 threads fixed)") and len(used) == 4


def test_the_thread_choices_ab_is_the_median_of_each_rounds_pair():
    """The record that read 0.80x by the sides' medians (the host slowed down between rounds): its rounds' own pairs
    read 0.80-1.01x, median 0.98x."""
    times = {"env": [1.1527, 1.1262, 0.9111, 0.8477, 0.8192], "own": [1.1408, 1.1378, 1.1418, 0.8628, 0.8645]}
    ratio, lo, hi = ce.paired(times)
    assert (round(ratio, 3), round(lo, 3), round(hi, 3)) == (0.982, 0.798, 1.01)
    assert round(statistics.median(times["env"]) / statistics.median(times["own"]), 3) == 0.801
    assert ce.paired({"own": [2.0], "env": [1.0]}) == (0.5, 0.5, 0.5)  # env's time over own's: own twice as slow


def test_the_hosts_read_speed_is_taken_before_each_call_and_set_beside_each_engines_rounds(monkeypatch):
    """interleaved(..., host) takes the host's read speed at the start of each call's pause, per engine and in call
    order; host_note gives an engine's spread and its speed's correlation with the host's (1 where the rounds follow
    the host, '-' where there is nothing to correlate)."""
    class Echo:
        def __init__(self, name):
            self.name = name

        def ask(self, task):
            calls.append(self.name)
            return {"seconds": 1.0 + len(calls), "tokens": [len(calls)]}

    calls, speeds = [], iter(range(100))
    monkeypatch.setattr(ce, "PAUSE", 0.0)
    monkeypatch.setattr(ce, "host_read_speed", lambda: float(next(speeds)))
    host = {}
    times, _ = ce.interleaved({"a": Echo("a"), "b": Echo("b")}, {"task": "decode"}, 3, host)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # the order rotates each round
    assert host == {"a": [0.0, 3.0, 4.0], "b": [1.0, 2.0, 5.0]}
    assert times == {"a": [2.0, 5.0, 6.0], "b": [3.0, 4.0, 7.0]}
    assert ce.interleaved({"a": Echo("a")}, {"task": "decode"}, 2)[0] == {"a": [8.0, 9.0]}  # no host: no probe
    assert ce.host_note([1.0, 1.25, 2.0], [20.0, 16.0, 10.0]) == \
        "speed max/min 2.00; host 10.0-20.0 GB/s before its calls, r = 1.00"
    assert ce.host_note([1.0, 1.25, 2.0], [10.0, 16.0, 20.0]).endswith("r = -0.97")
    assert ce.host_note([1.0, 1.0], [10.0, 12.0]).endswith("r = -") and ce.host_note([1.0], [3.0]).endswith("r = -")
    assert 0.5 < ce.host_read_speed() < 1000  # a real probe: GB/s of one core's sums
