"""Greedy decoding against the CPU engines people pick for speed: ours (fp32; bf16 weights; int8 and int4 weight-only, and
w8a8 and w4a8: the same weights with int8 activations) beside transformers, ONNX Runtime
(fp32 and dynamic int8, a plain decode loop over an exported graph with past keys and values) and llama.cpp (f32,
f16, q8_0, q4_0 through llama-cpp-python, converted by llama.cpp's own convert_hf_to_gguf.py from OUR
save_pretrained output: the interop is part of the test).

Every engine gets the same weights (a random-init gpt2, seeded), runs in its own worker process with the same thread
count, and is timed in interleaved rounds (one engine busy at a time, the order rotated each round, PAUSE seconds
between calls so that no engine's idle-spinning threads overlap the next one's call), so load from other processes
hits all alike; medians are reported. Each row's greedy tokens are compared with transformers' fp32.
After the warm-up call every worker runs one full garbage collection (`gc.collect()`): a fresh process's first one
sweeps every object its imports left (about 0.1 s in a process with torch and transformers) and fell, uncollected, in
the 4th 64-token call of ours: one round in five, 20% of a w4a8 call. What the rounds time is the steady state, where
none came in 150 calls (docs/cpu-decoding.md, "Stable speed").

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -r bench/requirements.txt   # ORT, onnx, gguf, llama-cpp-python (builds)
    python bench/compare_engines.py                 # quiet machine: decode b1, its prompt's first token, prefill 512
    python bench/compare_engines.py --busy 1        # with one competing process spinning on a core
    python bench/compare_engines.py --engines ours-fp32 ort-fp32 llama-f32   # a subset

ours-fp32-fixed is ours fp32 with every decode step and prompt block on --threads threads (GPT2_DECODE_THREADS,
GPT2_PROMPT_THREADS) in a process of its own: a row of the table. The "thread choice" rows (models/decode_threads.py
against that fixed count) are timed in ours-fp32's own process, its calls alternating between the choice and the
fixed count (the variables set per call), and each round's two adjacent calls give one ratio, the rounds' median
reported (a host that changes speed between rounds moves both calls of a round alike): two processes running the
same code differ by up to 3% here (where their memory landed), more than the choice costs, so a ratio of two
processes would measure their placement. The ratio across the two processes is in the row's notes.

An engine whose package is missing is skipped with the reason. The exported files are cached under --workdir
(default ~/.cache/gpt2-cs224n/engines), keyed by the seed; --fresh rebuilds them.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.machine import busy_suffix, print_machine_header, spin, stop  # noqa: E402
from bench.results import Recorder  # noqa: E402

SHARED = ROOT.parent / "shared"
ENGINES = ("ours-fp32", "ours-fp32-fixed", "ours-bf16", "ours-int8", "ours-w8a8", "ours-int4", "ours-w4a8", "hf-fp32",
           "ort-fp32", "ort-int8", "llama-f32", "llama-f16", "llama-q8_0", "llama-q4_0")
REFERENCE = "hf-fp32"  # whose greedy tokens the others are compared with
GGUF_TYPES = {"llama-f32": "f32", "llama-f16": "f16", "llama-q8_0": "q8_0", "llama-q4_0": "q4_0"}
# the targets of issue 38: ours fp32 >= the faster of ORT fp32 and llama.cpp f32; int8 >= ORT int8 and q8_0;
# int4 >= q4_0 (issue 53: each 8-bit and 4-bit form of ours, weight-only and with int8 activations)
# 16-bit weights: ours bf16 >= llama.cpp f16 (the 16-bit engine here; ONNX Runtime's CPU kernels have no bf16 MatMul)
TARGETS = {"ours-fp32": ("ort-fp32", "llama-f32"), "ours-bf16": ("llama-f16",), "ours-int8": ("ort-int8", "llama-q8_0"),
           "ours-w8a8": ("ort-int8", "llama-q8_0"), "ours-int4": ("llama-q4_0",), "ours-w4a8": ("llama-q4_0",)}
# issue 53: the thread choice (models/decode_threads.py; decode steps, and a long prompt's blocks) against the
# engines' thread count fixed (GPT2_DECODE_THREADS, GPT2_PROMPT_THREADS): within 3% of its speed on a quiet machine;
# with a core busy, faster than it
FIXED_THREADS = "ours-fp32-fixed"
THREADS_TARGET = {False: 0.97, True: 1.0}  # ours-fp32 / ours-fp32-fixed: quiet, busy
QUANTIZE = {"ours-int8": "int8", "ours-w8a8": "w8a8", "ours-int4": "int4", "ours-w4a8": "w4a8"}  # generate(quantize=)


# ---- the artefacts: one model, saved by us, exported to ONNX and converted to GGUF -----------------------------------

def missing(engine: str) -> str | None:
    """Why `engine` cannot run here (a package absent), or None."""
    import importlib.util

    needs = {"ort": ("onnxruntime", "onnx"), "llama": ("llama_cpp", "gguf")}.get(engine.split("-")[0], ())
    absent = [name for name in needs if importlib.util.find_spec(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (pip install -r bench/requirements.txt)"
    if engine.startswith("llama") and not (SHARED / "gpt2-tokenizer").exists():
        return f"llama.cpp's converter needs the GPT-2 tokenizer files, not found at {SHARED / 'gpt2-tokenizer'}"
    return None


def save_model(folder: Path, seed: int) -> Path:
    """A random-init transformers gpt2 (seeded), loaded by ours and written by our save_pretrained."""
    target = folder / "model"
    if (target / "model.safetensors").exists():
        return target
    import torch
    import transformers

    from config import GPT2Config
    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(GPT2Config.from_preset("gpt2").to_hf())
    staging = folder / "hf-staging"
    hf.save_pretrained(staging)
    ours = GPT2LMHeadModel.from_pretrained(staging)
    ours.save_pretrained(target)
    shutil.rmtree(staging)
    return target


class OnnxGraph:
    """The export wrapper: GPT-2's arithmetic in plain torch ops over the HF-layout weights, with the past keys and
    values as inputs and outputs (one pair per layer, as optimum exports them), so ONNX Runtime gets a graph of
    MatMul + Add, LayerNormalization, Softmax and Concat: the form its dynamic int8 quantizer rewrites (a Gemm
    would be left in fp32)."""

    @staticmethod
    def module(model_dir: Path):
        import torch
        from safetensors.torch import load_file
        from torch import nn

        config = json.loads((model_dir / "config.json").read_text())
        sd = load_file(model_dir / "model.safetensors")
        L, H, C = config["n_layer"], config["n_head"], config["n_embd"]
        eps = config["layer_norm_epsilon"]

        class Graph(nn.Module):
            def __init__(self):
                super().__init__()
                for name, value in sd.items():
                    self.register_buffer(name.replace(".", "_"), value)

            def w(self, name):
                return getattr(self, name.replace(".", "_"))

            def ln(self, x, prefix):
                return nn.functional.layer_norm(x, (C,), self.w(prefix + ".weight"), self.w(prefix + ".bias"), eps)

            def forward(self, input_ids, position_ids, *past):
                T, P = input_ids.shape[1], past[0].shape[2]
                x = self.w("transformer.wte.weight")[input_ids] + self.w("transformer.wpe.weight")[position_ids]
                rows = torch.arange(T)[:, None] + P
                cols = torch.arange(P + T)[None, :]
                bias = torch.where(cols > rows, torch.tensor(float("-inf")), torch.tensor(0.0))
                presents = []
                for i in range(L):
                    p = f"transformer.h.{i}."
                    h = self.ln(x, p + "ln_1")
                    qkv = h @ self.w(p + "attn.c_attn.weight") + self.w(p + "attn.c_attn.bias")
                    q, k, v = (t.reshape(1, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=-1))
                    k = torch.cat([past[2 * i], k], dim=2)
                    v = torch.cat([past[2 * i + 1], v], dim=2)
                    presents += [k, v]
                    att = torch.softmax(q @ k.transpose(-1, -2) * (C // H) ** -0.5 + bias, dim=-1)
                    y = (att @ v).transpose(1, 2).reshape(1, T, C)
                    x = x + y @ self.w(p + "attn.c_proj.weight") + self.w(p + "attn.c_proj.bias")
                    h = self.ln(x, p + "ln_2")
                    h = h @ self.w(p + "mlp.c_fc.weight") + self.w(p + "mlp.c_fc.bias")
                    h = nn.functional.gelu(h, approximate="tanh")
                    x = x + h @ self.w(p + "mlp.c_proj.weight") + self.w(p + "mlp.c_proj.bias")
                x = self.ln(x[:, -1:], "transformer.ln_f")
                return (x @ self.w("transformer.wte.weight").t(), *presents)

        return Graph().eval(), config


def export_onnx(model_dir: Path, folder: Path) -> dict[str, Path]:
    """model.onnx (fp32) and model-int8.onnx (onnxruntime.quantization.quantize_dynamic, int8 weights)."""
    fp32, int8 = folder / "model.onnx", folder / "model-int8.onnx"
    if not fp32.exists():
        import torch

        graph, config = OnnxGraph.module(model_dir)
        L, H, C = config["n_layer"], config["n_head"], config["n_embd"]
        past = [torch.zeros(1, H, 3, C // H) for _ in range(2 * L)]
        names = [f"past.{i // 2}.{'kv'[i % 2]}" for i in range(2 * L)]
        outputs = ["logits"] + [f"present.{i // 2}.{'kv'[i % 2]}" for i in range(2 * L)]
        axes = {"input_ids": {1: "new"}, "position_ids": {1: "new"}}
        axes.update({n: {2: "past"} for n in names})
        axes.update({n: {2: "total"} for n in outputs[1:]})
        ids = torch.tensor([[1, 2]])
        tmp = folder / "model.onnx.tmp"
        with torch.no_grad():
            torch.onnx.export(graph, (ids, ids + 3, *past), str(tmp), input_names=["input_ids", "position_ids", *names],
                              output_names=outputs, dynamic_axes=axes, opset_version=17, dynamo=False)
        os.replace(tmp, fp32)
    if not int8.exists():
        from onnxruntime.quantization import QuantType, quantize_dynamic

        tmp = folder / "model-int8.tmp.onnx"
        quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8)
        os.replace(tmp, int8)
    return {"ort-fp32": fp32, "ort-int8": int8}


def converter(folder: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py of the installed llama-cpp-python's own llama.cpp (its sdist, fetched with
    pip download once): the converter and its gguf-py, conversion/ beside it."""
    import importlib.metadata

    version = importlib.metadata.version("llama_cpp_python")
    root = folder / f"llama.cpp-{version}"
    script = root / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    download = folder / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(download),
                    f"llama-cpp-python=={version}"], check=True, capture_output=True, text=True)
    sdist = next(download.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        wanted = (prefix + "conversion/", prefix + "gguf-py/")
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
            m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith(wanted))]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    return script


def convert_gguf(model_dir: Path, folder: Path, engines: list[str]) -> dict[str, Path]:
    """GGUF files of our saved model: f32 and f16 by the converter, q8_0 and q4_0 quantized from f32 by
    llama_cpp.llama_model_quantize (what llama-quantize does; llama-cpp-python builds no tools)."""
    wanted = [e for e in engines if e in GGUF_TYPES]
    if not wanted:
        return {}
    files = {e: folder / f"model-{GGUF_TYPES[e]}.gguf" for e in wanted}
    f32 = folder / "model-f32.gguf"
    source = folder / "hf-for-gguf"  # our files plus the tokenizer the converter embeds
    if not source.exists():
        shutil.copytree(model_dir, source)
        for name in os.listdir(SHARED / "gpt2-tokenizer"):
            shutil.copy(SHARED / "gpt2-tokenizer" / name, source / name)
    script = converter(folder)
    env = {**os.environ, "PYTHONPATH": f"{script.parent / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for outtype in ("f32", "f16"):
        out = folder / f"model-{outtype}.gguf"
        if not out.exists() and (outtype == "f32" or out in files.values()):
            run = subprocess.run([sys.executable, str(script), str(source), "--outtype", outtype, "--outfile",
                                  str(out)], capture_output=True, text=True, env=env)
            if run.returncode != 0:
                raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{run.stderr[-3000:]}")
    for engine, path in files.items():
        if not path.exists() and GGUF_TYPES[engine] not in ("f32", "f16"):
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
                            "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[GGUF_TYPES[engine]]
            params.nthread = os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize to {GGUF_TYPES[engine]} failed")
    return files


def streamed_bytes(engine: str, path: Path | None, model_dir: Path) -> int:
    """The bytes of weights one decode step reads: every matrix once (the tied token embedding once, as the LM head),
    not the position table (one row a token). ours-int8: int8 rows plus one fp32 scale a row; the others: their
    files' tensors as stored (GGUF tensor sizes; ONNX initializers feeding products)."""
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: math.prod(s) for k, s in shapes.items() if "wpe" not in k}
    if engine in ("ours-fp32", FIXED_THREADS, "hf-fp32"):
        return 4 * sum(numel.values())
    if engine == "ours-bf16":
        return 2 * sum(numel.values())
    if engine in ("ours-int8", "ours-w8a8"):  # int8 rows, one fp32 scale a row (HF's Conv1D weights: (in, out))
        return sum(n + 4 * shapes[k][0 if "wte" in k else 1] if len(shapes[k]) == 2 else 4 * n
                   for k, n in numel.items())
    if engine in ("ours-int4", "ours-w4a8"):  # two values a byte, one fp32 scale per 32 (modules/quant.py)
        return sum(n // 2 + 4 * n // 32 if len(shapes[k]) == 2 else 4 * n for k, n in numel.items())
    if engine.startswith("llama"):
        from gguf import GGUFReader

        return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if "position" not in t.name)
    import onnx

    graph = onnx.load(str(path), load_external_data=True).graph
    gathers = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    others = {i for n in graph.node if n.op_type != "Gather" for i in n.input}
    return sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in graph.initializer
               if t.name in others or t.name not in gathers)


# ---- the workers: one process per engine, driven over a pipe --------------------------------------------------------

class Ours:
    def __init__(self, engine, model_dir, path, threads):
        import torch

        from models.gpt2 import GPT2LMHeadModel

        self.torch = torch
        # ours-bf16: loaded as bf16 (its weights in the loader's 2 MiB pages, as fp32's are)
        dtype = torch.bfloat16 if engine == "ours-bf16" else None
        self.model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=dtype).eval()
        self.quantize = QUANTIZE.get(engine)

    def decode(self, prompt, new):
        ids = self.torch.tensor([prompt])
        with self.torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=new, do_sample=False, quantize=self.quantize)
        return out[0, len(prompt):].tolist()

    def prefill(self, prompt):
        """The time to the first new token: the prompt's pass and the LM head of its last position only."""
        return self.decode(prompt, 1)[0]

    def build(self) -> str:
        """What runs: torch, its CPU capability and whether the decoding kernel (modules/rows.cpp) is built."""
        from modules import rows

        capability = self.torch.backends.cpu.get_cpu_capability()
        kernel = f"rows kernel {'built' if rows.available() else 'not built'}"
        return f"torch {self.torch.__version__}, CPU capability {capability}; {kernel}"


class Transformers(Ours):
    def __init__(self, engine, model_dir, path, threads):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.model = transformers.GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        self.model.generation_config.eos_token_id = None  # always max_new_tokens, as ours without eos_token_id
        self.model.generation_config.pad_token_id = 50256

    def decode(self, prompt, new):
        ids = self.torch.tensor([prompt])
        with self.torch.no_grad():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new,
                                      do_sample=False)
        return out[0, len(prompt):].tolist()

    def build(self) -> str:
        import transformers

        return f"transformers {transformers.__version__}, torch {self.torch.__version__}"


class OnnxRuntime:
    def __init__(self, engine, model_dir, path, threads):
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.np = np
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        config = json.loads((model_dir / "config.json").read_text())
        self.layers, self.heads, self.width = config["n_layer"], config["n_head"], config["n_embd"]
        self.names = [f"past.{i // 2}.{'kv'[i % 2]}" for i in range(2 * self.layers)]

    def _run(self, ids, start, past):
        np = self.np
        feed = {"input_ids": np.array([ids], dtype=np.int64),
                "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None]}
        feed.update(zip(self.names, past))
        logits, *present = self.session.run(None, feed)
        return int(logits[0, -1].argmax()), present

    def _empty(self):
        return [self.np.zeros((1, self.heads, 0, self.width // self.heads), self.np.float32)] * (2 * self.layers)

    def decode(self, prompt, new):
        token, past = self._run(prompt, 0, self._empty())
        out = [token]
        for step in range(new - 1):
            token, past = self._run([token], len(prompt) + step, past)
            out.append(token)
        return out

    def prefill(self, prompt):
        return self._run(prompt, 0, self._empty())[0]

    def build(self) -> str:
        import onnxruntime as ort

        return f"onnxruntime {ort.__version__}, {', '.join(self.session.get_providers())}"


class LlamaCpp:
    def __init__(self, engine, model_dir, path, threads):
        import llama_cpp
        import numpy as np

        self.np, self.llama_cpp = np, llama_cpp
        self.llm = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()

    def build(self) -> str:
        """llama-cpp-python's version and its ggml build's CPU features (AVX2, AVX512, AMX ... = 1 where compiled in:
        a -DGGML_NATIVE=ON build has the building CPU's)."""
        info = self.llama_cpp.llama_print_system_info().decode(errors="replace").strip(" |")
        return f"llama-cpp-python {self.llama_cpp.__version__}: {info}"

    def _last(self):
        """argmax of the last evaluated token's logits (llama-cpp-python keeps no copy unless logits_all)."""
        logits = self.np.ctypeslib.as_array(self.llama_cpp.llama_get_logits(self.llm.ctx), shape=(self.vocab,))
        return int(self.np.argmax(logits))

    def decode(self, prompt, new):
        self.llm.reset()
        self.llm.eval(prompt)
        out = [self._last()]
        for _ in range(new - 1):
            self.llm.eval([out[-1]])
            out.append(self._last())
        return out

    def prefill(self, prompt):
        self.llm.reset()
        self.llm.eval(prompt)
        return self._last()


def environment(env: dict):
    """os.environ with `env` set within the block; each variable as it was (or unset) after it (the standard
    library's unittest.mock.patch.dict)."""
    return mock.patch.dict(os.environ, env)


def worker(engine: str, model_dir: Path, path: Path | None, threads: int) -> None:
    """Load `engine`, answer 'ready', then time each request from stdin: one JSON line in, one out."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the engines print goes to stderr, never into the replies
    if engine.startswith(("ours", "hf")):
        import torch

        torch.set_num_threads(threads)
    kind = {"ours": Ours, "hf": Transformers, "ort": OnnxRuntime, "llama": LlamaCpp}[engine.split("-")[0]]
    runner = kind(engine, model_dir, path, threads)
    reply.write(json.dumps({"ready": True, "build": runner.build()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        task = json.loads(line)
        if task["task"] == "collect":  # once, after the warm-up (see the module's docstring)
            start = time.perf_counter()
            found = gc.collect()
            reply.write(json.dumps({"seconds": time.perf_counter() - start, "found": found,
                                    "full_collections": gc.get_stats()[2]["collections"]}) + "\n")
            reply.flush()
            continue
        with environment(task.get("env", {})):  # this call only (the thread choice's A/B: GPT2_DECODE_THREADS=N)
            start = time.perf_counter()
            if task["task"] == "decode":
                tokens = runner.decode(task["prompt"], task["new"])
            else:
                tokens = [runner.prefill(task["prompt"])]
            seconds = time.perf_counter() - start
        reply.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        reply.flush()


class Worker:
    def __init__(self, engine: str, model_dir: Path, path: Path | None, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if engine == FIXED_THREADS:  # every decode step on `threads` threads: the thread choice's baseline
            env["GPT2_DECODE_THREADS"] = env["GPT2_PROMPT_THREADS"] = str(threads)
        cmd = [sys.executable, __file__, "--worker", engine, "--model-dir", str(model_dir), "--threads", str(threads)]
        if path is not None:
            cmd += ["--path", str(path)]
        self.engine = engine
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.build = self.ask(None).get("build", "")  # what the engine runs (versions, the CPU features built in)

    def ask(self, task: dict | None) -> dict:
        if task is not None:
            self.proc.stdin.write(json.dumps(task) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.engine} worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- the driver ---------------------------------------------------------------------------------------------------

# Seconds between two engines' calls. An engine's worker threads keep spinning on the cores for a while after its call
# returns (ONNX Runtime's pool, OpenMP's teams) and took them from the next engine's first milliseconds: a 16-token
# prompt of ours timed 71 ms (median of 21 rounds) right after ONNX Runtime's calls against 50 beside another process
# of ours, and ORT's 36 against 29 beside llama.cpp; with 0.2 s between calls, 49 and 31 (Zen 4, 2026-12-01). A user
# runs one engine: each is timed as it runs alone.
PAUSE = 0.2

PROBE = None  # the host probe's buffer (64 MB), made at its first use


def host_read_speed() -> float:
    """The host's memory read speed now, GB/s: the best of 3 numpy sums of 64 MB on one core (numpy keeps no thread
    pool spinning after it, unlike torch's). Taken before each timed call of the engines bench, it tells the host's
    own rounds from an engine's: a 2-core cloud VM's memory speed changes within seconds with its neighbours."""
    import numpy as np

    global PROBE
    if PROBE is None:
        PROBE = np.ones(16 * 2**20, dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        PROBE.sum()
        best = min(best, time.perf_counter() - start)
    return PROBE.nbytes / best / 1e9


def interleaved(workers: dict[str, Worker], task: dict, rounds: int,
                host: dict[str, list[float]] | None = None) -> tuple[dict, dict]:
    """Each round asks every engine once, in an order rotated per round -> (seconds lists, last tokens). Each call
    waits PAUSE first (see PAUSE); with `host`, the host's read speed (host_read_speed) is taken at the start of that
    pause and appended to host[engine]."""
    names, times, tokens = list(workers), {n: [] for n in workers}, {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if host is not None:
                host.setdefault(name, []).append(host_read_speed())
            time.sleep(PAUSE)
            answer = workers[name].ask(task)
            times[name].append(answer["seconds"])
            tokens[name] = answer["tokens"]
    return times, tokens


def alternating(worker: Worker, task: dict, env: dict, rounds: int) -> dict:
    """One worker's calls of `task` alternating between its own setting and `env` (set for that call only), the
    order swapped each round -> {"own": seconds, "env": seconds}."""
    times = {"own": [], "env": []}
    for r in range(rounds):
        for which in (("own", "env") if r % 2 == 0 else ("env", "own")):
            times[which].append(worker.ask({**task, "env": env} if which == "env" else task)["seconds"])
    return times


def host_note(seconds: list[float], host: list[float]) -> str:
    """An engine's rounds against the host's read speed before each: 'speed max/min 1.31; host 9.8-14.2 GB/s before
    its calls, r = 0.85' (r: the correlation of the call's speed, 1 / seconds, with the host's; near 1, the rounds
    follow the host's memory; near 0, something else moves them)."""
    try:
        r = f"{statistics.correlation([1 / t for t in seconds], host):.2f}"
    except statistics.StatisticsError:  # fewer than 2 rounds, or a constant side
        r = "-"
    return (f"speed max/min {max(seconds) / min(seconds):.2f}; host {min(host):.1f}-{max(host):.1f} GB/s before its "
            f"calls, r = {r}")


def paired(times: dict) -> tuple[float, float, float]:
    """An `alternating` A/B's speed ratio, own setting over env's: the median, min and max over its rounds of each
    round's two adjacent calls (env's seconds / own's). A host that changes speed between rounds (this one switches
    between two levels minutes apart, 0.82-0.86 s against 1.10-1.15 s for the same call) moves both calls of a round
    alike, where a ratio of the two sides' medians took one side's slow rounds against the other's fast ones: 0.80x
    from rounds whose own pairs gave 0.95-1.01x."""
    ratios = sorted(env / own for own, env in zip(times["own"], times["env"]))
    return statistics.median(ratios), ratios[0], ratios[-1]


def agreement(tokens: list[int], reference: list[int]) -> str:
    """'64/64' (identical), else the first position where they part."""
    if tokens == reference:
        return f"{len(tokens)}/{len(reference)} identical"
    first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    same = sum(a == b for a, b in zip(tokens, reference))
    return f"first {first} identical ({same}/{len(reference)} positions equal)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill rows (0: skip)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on a core each during the timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                        / "gpt2-cs224n" / "engines")
    parser.add_argument("--fresh", action="store_true", help="rebuild the saved, exported and converted files")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.path, args.threads)

    import torch

    torch.set_num_threads(args.threads)
    print_machine_header()
    folder = args.workdir / f"gpt2-seed{args.seed}"
    if args.fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    engines = []
    for engine in args.engines:
        if why := missing(engine):
            print(f"skipping {engine}: {why}", flush=True)
        else:
            engines.append(engine)
    if REFERENCE not in engines:
        engines.insert(0, REFERENCE)
    started = time.perf_counter()
    model_dir = save_model(folder, args.seed)
    paths: dict[str, Path | None] = {e: None for e in engines}
    if any(e.startswith("ort") for e in engines):
        paths.update({e: p for e, p in export_onnx(model_dir, folder).items() if e in engines})
    paths.update(convert_gguf(model_dir, folder, engines))
    print(f"files ready in {time.perf_counter() - started:.0f} s under {folder}", flush=True)
    from bench.compare_hf import read_bandwidth  # the same probe as compare_hf's tables

    bandwidth = read_bandwidth()
    limits = {e: bandwidth * 1e9 / streamed_bytes(e, paths[e], model_dir) for e in engines}
    print(f"memory reads {bandwidth:.1f} GB/s; threads {args.threads} per engine; {args.rounds} interleaved rounds",
          flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, 50257, (args.prompt_tokens,), generator=gen).tolist()
    long_prompt = torch.randint(0, 50257, (args.prefill,), generator=gen).tolist()
    workers = {}
    spinners = []
    rec = Recorder("compare_engines")
    try:
        for engine in engines:
            workers[engine] = Worker(engine, model_dir, paths[engine], args.threads)
            print(f"{engine}: {workers[engine].build}", flush=True)
        decode = {"task": "decode", "prompt": prompt, "new": args.new_tokens}
        interleaved(workers, decode, 1)  # warm-up: first calls build kernels, caches and plans
        swept = {name: w.ask({"task": "collect"})["seconds"] for name, w in workers.items()}
        print("a full garbage collection after the warm-up: "
              + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in swept.items()), flush=True)
        spinners = spin(args.busy)
        host = {}  # the host's read speed before each decode call
        times, tokens = interleaved(workers, decode, args.rounds, host)
        prefill = {"task": "prefill", "prompt": long_prompt}
        pre_times = interleaved(workers, prefill, args.rounds)[0] if args.prefill else {}
        # the decode rows' own prompt to its first token: a short prompt's pass, the LM head's one row
        first_times = interleaved(workers, {"task": "prefill", "prompt": prompt}, args.rounds)[0]
        fixed = {"GPT2_DECODE_THREADS": str(args.threads), "GPT2_PROMPT_THREADS": str(args.threads)}
        ab = {"decode": alternating(workers["ours-fp32"], decode, fixed, args.rounds)} if "ours-fp32" in workers \
            else {}
        if ab and args.prefill:
            ab["prefill"] = alternating(workers["ours-fp32"], prefill, fixed, args.rounds)
        load = os.getloadavg()[0]
    finally:
        stop(spinners)
        for w in workers.values():
            w.close()
    busy = busy_suffix(args.busy)
    rate = {e: args.new_tokens / statistics.median(times[e]) for e in engines}
    print(f"\ngreedy batch 1, {args.prompt_tokens}-token prompt + {args.new_tokens} new tokens{busy} [load {load:.1f}]")
    print(f"{'engine':<12} {'tok/s':>7} {'range':>13} {'of its limit':>12} {'vs ours fp32':>12}  tokens vs {REFERENCE}")
    base = rate.get("ours-fp32")
    for e in engines:
        match = agreement(tokens[e], tokens[REFERENCE])
        vs = f"{rate[e] / base:.2f}" if base else "-"
        spread = f"{args.new_tokens / max(times[e]):.1f}-{args.new_tokens / min(times[e]):.1f}"
        print(f"{e:<12} {rate[e]:>7.1f} {spread:>13} {100 * rate[e] / limits[e]:>11.0f}% {vs:>12}  {match}")
        extra = {}
        if e in TARGETS and any(t in rate for t in TARGETS[e]):
            best = max(rate[t] for t in TARGETS[e] if t in rate)
            extra = dict(ratio=rate[e] / best, ratio_of=f"{e} / fastest of {' and '.join(TARGETS[e])}",
                         target=f">= 1.0x the fastest of {', '.join(TARGETS[e])}", met=rate[e] >= best)
        rec.add(f"decode b1 {e}{busy}", {e: rate[e], **({"ours-fp32": base} if base and e != "ours-fp32" else {})},
                "new tokens/s", notes=f"{100 * rate[e] / limits[e]:.0f}% of its read-bandwidth limit "
                f"({limits[e]:.1f} tok/s at {bandwidth:.1f} GB/s); tokens vs {REFERENCE}: {match}; "
                + host_note(times[e], host[e]),
                engine=e, kind="decode", busy=args.busy, threads=args.threads, build=workers[e].build,
                share=rate[e] / limits[e], tokens=match, seconds=times[e], host_gbs=host[e], **extra)
    print(f"the host's memory read speed before each decode call (one core, GB/s): {min(sum(host.values(), [])):.1f}-"
          f"{max(sum(host.values(), [])):.1f}; per engine, its rounds' speed max/min and their correlation with it:")
    for e in engines:
        print(f"  {e:<12} {host_note(times[e], host[e])}")
    goal = THREADS_TARGET[bool(args.busy)]
    if "decode" in ab:
        own, env = (args.new_tokens / statistics.median(ab["decode"][k]) for k in ("own", "env"))
        ratio, lo, hi = paired(ab["decode"])
        across = f"; across processes (ours-fp32 / {FIXED_THREADS}): {rate['ours-fp32'] / rate[FIXED_THREADS]:.3f}" \
            if FIXED_THREADS in rate else ""
        print(f"thread choice: {ratio:.3f}x ({lo:.3f}-{hi:.3f}) the speed of {args.threads} threads every step "
              f"(ours-fp32's process, {args.rounds} calls each, alternating: the median of each round's pair; of "
              f"the sides' medians {own / env:.3f}x{across}); target >= {goal:.2f}x")
        rec.add(f"decode b1 thread choice{busy}", {"ours-fp32": own, FIXED_THREADS: env}, "new tokens/s",
                ratio=ratio, ratio_of=f"ours-fp32 / the same process with {args.threads} threads fixed (calls "
                f"alternating; the median of each round's pair)", target=f">= {goal:.2f}x {args.threads} threads "
                f"fixed{busy}", met=ratio >= goal, kind="threads", busy=args.busy, threads=args.threads,
                seconds=ab["decode"], notes=f"one process, {args.rounds} calls each, alternating; pairs "
                f"{lo:.3f}-{hi:.3f}; the sides' medians {own / env:.3f}x{across}")
    print(f"\nfirst token of the decode rows' {args.prompt_tokens}-token prompt{busy} (ms, median; range over rounds)")
    first = {e: statistics.median(first_times[e]) for e in engines}
    for e in engines:
        print(f"{e:<12} {1e3 * first[e]:>7.1f}  {1e3 * min(first_times[e]):.1f}-{1e3 * max(first_times[e]):.1f}")
        rec.add(f"first token {args.prompt_tokens} {e}{busy}", {e: first[e]}, "seconds", engine=e, kind="first-token",
                build=workers[e].build, busy=args.busy, tokens_in=args.prompt_tokens, seconds=first_times[e])
    if pre_times:
        print(f"\nprefill of {args.prefill} tokens{busy} (seconds, median)")
        seconds = {e: statistics.median(pre_times[e]) for e in engines}
        others = {e: s for e, s in seconds.items() if not e.startswith("ours")}
        best = min(seconds.values())
        for e in engines:
            print(f"{e:<12} {seconds[e]:>7.3f}  {seconds[e] / best:.2f}x the fastest")
            extra = {}
            if e == "ours-fp32" and others:  # issue 38: prefill <= the best engine's
                fastest = min(others, key=others.get)
                extra = dict(ratio=seconds[e] / others[fastest], ratio_of=f"ours-fp32 / {fastest} (time)",
                             target="<= the fastest other engine's time", met=seconds[e] <= others[fastest])
            rec.add(f"prefill {args.prefill} {e}{busy}", {e: seconds[e]}, "seconds", engine=e, kind="prefill",
                    build=workers[e].build, busy=args.busy, tokens_in=args.prefill, seconds=pre_times[e], **extra)
        if "prefill" in ab:  # the prompt's blocks: the same targets as the steps'
            own, env = (statistics.median(ab["prefill"][k]) for k in ("own", "env"))
            ratio, lo, hi = paired(ab["prefill"])
            across = f"; across processes ({FIXED_THREADS} time / ours-fp32 time): " \
                f"{seconds[FIXED_THREADS] / seconds['ours-fp32']:.3f}" if FIXED_THREADS in seconds else ""
            print(f"prompt thread choice: {ratio:.3f}x ({lo:.3f}-{hi:.3f}) the speed of {args.threads} threads every "
                  f"block (ours-fp32's process, {args.rounds} calls each, alternating: the median of each round's "
                  f"pair; of the sides' medians {env / own:.3f}x{across}); target >= {goal:.2f}x")
            rec.add(f"prefill {args.prefill} thread choice{busy}", {"ours-fp32": own, FIXED_THREADS: env}, "seconds",
                    ratio=ratio, ratio_of=f"the same process with {args.threads} threads fixed: time / ours-fp32 time "
                    f"(calls alternating; the median of each round's pair)", met=ratio >= goal, kind="prompt-threads",
                    target=f">= {goal:.2f}x the speed of {args.threads} threads fixed{busy}", busy=args.busy,
                    threads=args.threads, tokens_in=args.prefill, seconds=ab["prefill"],
                    notes=f"one process, {args.rounds} calls each, alternating; pairs {lo:.3f}-{hi:.3f}; the sides' "
                    f"medians {env / own:.3f}x{across}")
    rec.write()
    print(f"\ndone in {time.perf_counter() - started:.0f} s; load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
