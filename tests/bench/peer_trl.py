"""grpo bench peer_trl: the same GRPO job in TRL (GRPOTrainer, transformers generation, CPU) and in
grpo-serve, same model directory, task, config and seed, measured side by side in one run
(docs/BENCHMARKS.md). Run through `grpo bench peer_trl [--json] [--fast]`, or directly with
the venv's Python (GRPO_BIN names the grpo binary; default <source>/build/services/grpo).

Rows (ratio = ours / TRL, measured in this run; the end-to-end rows are medians over
--e2e-rounds rounds of both sides back to back, with each round's own ratio in round_ratios):
  e2e_steps_per_s, e2e_time_to_threshold_s : the demo task (train-local vs GRPOTrainer.train),
                                             ours from the process's start, TRL's from its
                                             on_train_begin (its model loaded); ours at its
                                             best layout (with 2+ threads also 1 intra-op
                                             thread and micro_batch_threads 2)
  e2e_steps_per_s_from_train_start         : the same, ours on TRL's clock too (from the first
                                             generation, the model loaded)
  services_e2e_steps_per_s,                : the same through the services (grpo demo: a learner
  services_e2e_time_to_threshold_s           and workers as processes on loopback, max_staleness
                                             1) at its best layout of workers x threads
                                             (with 2+ threads also 1 worker beside a learner
                                             with micro_batch_threads 2), vs
                                             GRPOTrainer.train; ours from the demo's start
  services_e2e_steps_per_s_from_job_start  : the same, ours on TRL's clock too (from the job's
                                             submission, the learner serving)
  generation_tokens_per_s                  : bench model, 4 demo prompts x G=16, 128 new tokens
                                             (32 with --fast)
                                             (grpo train-local's generation_seconds at
                                             learning_rate 0 vs model.generate, TRL's config)
  learner_step_s                           : bench model, G=16 x (64 + 128), micro-batch 4
                                             (grpo bench learner_step vs 4 x trainer.training_step
                                             + clip + AdamW step)
  peak_mib_G<g>, peak_mib_G64_over_G4      : loss + backward of G sequences, fresh process each
                                             (grpo bench logprob_memory "chunked" vs TRL's
                                             _compute_loss on a G-sequence batch)
  loss_agreement                           : our dumped step loss vs TRL's _compute_loss

`--check-loss-agreement` runs only the loss check (the ctest peer_trl_loss_test).
`--child-trl-memory G --model DIR` is internal (one memory configuration).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("GRPO_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
GRPO_BIN = os.environ.get("GRPO_BIN") or os.path.join(SOURCE_DIR, "build", "services", "grpo")
THREADS = int(os.environ.get("GRPO_BENCH_THREADS", os.cpu_count() or 1))

# The demo task (services/demo_task.cc): 8 chat prompts, TRL's reward_len in tokens, target 8.
DEMO_QUESTIONS = ["Say hi.", "Name a colour.", "Count to three.", "Pick a number.",
                  "Greet me.", "Name a fruit.", "Say yes or no.", "Name an animal."]
TARGET_LENGTH = 8
PROMPT_LEN, COMPLETION_LEN = 64, 128  # the bench model's shapes (docs/BENCHMARKS.md)


def chat_prompt(question):
    # common/tokenizer/chat_template.cc: ChatML with the generation prompt.
    return "<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n"


def make_reward_len(target):
    def reward_len(completions, completion_ids=None, **kwargs):
        # grpo's "length" reward (rollout/reward.cc): -|target - completion tokens|, the tokens
        # up to and including EOS (TRL's completion_ids are the same: masked after the first EOS).
        return [-float(abs(target - len(ids))) for ids in completion_ids]
    reward_len.__name__ = "length"
    return reward_len


def ours_env(threads=None):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads or THREADS)
    # grpo's own OpenMP settings (services/cli/launch.cc: PASSIVE, after a bounded spin when
    # computing alone), unless the caller set them.
    return env


def run_grpo(args, check=True):
    p = subprocess.run([GRPO_BIN] + args, env=ours_env(), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"grpo {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def init_model(preset, out_dir, seed=1):
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        run_grpo(["init-model", "--preset", preset, "--out", out_dir, "--seed", str(seed)])
    return out_dir


def setup_torch():
    import torch
    torch.set_num_threads(THREADS)
    return torch


def quiet_libs():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import warnings
    warnings.filterwarnings("ignore")
    try:
        import transformers.utils.logging as tl
        tl.disable_progress_bar()
        tl.set_verbosity_error()
    except Exception:
        pass
    import logging
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def grpo_job_config(steps):
    """The GRPO job both sides run (TRL GRPOConfig names; ours takes them as --key value)."""
    return dict(num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                max_completion_length=24, learning_rate=3e-3, lr_scheduler_type="constant",
                loss_type="dapo", beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group",
                temperature=1.0, top_p=1.0, top_k=0, max_grad_norm=1.0, weight_decay=0.0, seed=1,
                max_steps=steps)


def make_trl_trainer(model_dir, job, out_dir, dataset_rows=None, model=None):
    """GRPOTrainer on CPU with transformers generation, fp32, no gradient checkpointing."""
    quiet_libs()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    tok = AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    rows = dataset_rows or [chat_prompt(q) for q in DEMO_QUESTIONS]
    # Enough rows that max_steps never runs out of prompts within an epoch boundary.
    n_rep = max(1, (job["max_steps"] * job["per_device_train_batch_size"] *
                    job["gradient_accumulation_steps"]) // (job["num_generations"] * len(rows)) + 1)
    ds = Dataset.from_dict({"prompt": rows * n_rep})
    cfg = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none",
                     logging_steps=1, save_strategy="no", gradient_checkpointing=False,
                     disable_tqdm=True, dataloader_num_workers=0, warmup_steps=0, **job)
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward_len(TARGET_LENGTH), args=cfg,
                          train_dataset=ds, processing_class=tok)
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)  # its per-step dicts on stdout
    return trainer


# ---------------------------------------------------------------------------------------------
# Loss agreement: one fixed batch, same weights, same completions.

def load_dump(path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def trl_loss_on_dump(trainer, dump, meta, per_token_logps=None):
    """TRL's GRPOTrainer._compute_loss over the micro-batches of one dumped optimizer step
    (our dump layout, README "Batch dumps"), summed as TRL accumulates a step. With
    per_token_logps (a [S, C] tensor), TRL's forward is replaced by those current-policy
    log-probs (to check the loss formula on weights we did not save). Returns
    (loss, TRL per-token log-probs [S, C])."""
    import torch
    sizes = json.loads(meta.get("micro_batch_sizes", "null")) or [dump["completion_ids"].size(0)]
    mask_all = dump["completion_mask"].float()
    tool_mask = dump["env_mask"].long() if "env_mask" in dump else None  # multi-turn dumps
    num_items = mask_all.sum() if tool_mask is None else (mask_all * tool_mask).sum()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = len(sizes)
    orig = trainer._get_per_token_logps_and_entropies
    total, logps, start = 0.0, [], 0
    for b in sizes:
        sl = slice(start, start + b)
        inputs = {"prompt_ids": dump["prompt_ids"][sl].long(),
                  "prompt_mask": dump["prompt_mask"][sl].long(),
                  "completion_ids": dump["completion_ids"][sl].long(),
                  "completion_mask": dump["completion_mask"][sl].float(),
                  "advantages": dump["advantages"][sl].float(),
                  "num_items_in_batch": num_items}
        if tool_mask is not None:
            inputs["tool_mask"] = tool_mask[sl]
        if "old_logprobs" in dump:
            inputs["old_per_token_logps"] = dump["old_logprobs"][sl].float()
        if "ref_logprobs" in dump:
            inputs["ref_per_token_logps"] = dump["ref_logprobs"][sl].float()
        if per_token_logps is not None:
            lp = per_token_logps[sl].float().clone().requires_grad_(True)

            def fake(*a, _lp=lp, **k):
                return _lp, torch.zeros_like(_lp), None
            trainer._get_per_token_logps_and_entropies = fake
            captured = lp
        else:
            captured = {}

            def wrap(*a, _c=captured, **k):
                out = orig(*a, **k)
                _c["lp"] = out[0].detach()
                return out
            trainer._get_per_token_logps_and_entropies = wrap
        try:
            with torch.no_grad():
                loss = trainer._compute_loss(trainer.model, inputs)
        finally:
            trainer._get_per_token_logps_and_entropies = orig
        total += float(loss)
        logps.append(captured.detach() if per_token_logps is not None else captured["lp"])
        start += b
    return total, torch.cat(logps, 0)


def import_trl_grpo_ref():
    """tests/reference/trl_grpo_ref.py: TRL's own _compute_loss on a dump (None if absent)."""
    ref_dir = os.path.join(SOURCE_DIR, "tests", "reference")
    if not os.path.exists(os.path.join(ref_dir, "trl_grpo_ref.py")):
        return None
    if ref_dir not in sys.path:
        sys.path.insert(0, ref_dir)
    import trl_grpo_ref
    return trl_grpo_ref


def ref_loss_on_dump(ref, case, dump, meta, per_token_logps=None):
    """The step's TRL loss through tests/reference/trl_grpo_ref.py. Without per_token_logps:
    its run_case (TRL's _compute_loss and forward on case["model_dir"]). With them: its
    TrainerStandIn's _compute_loss, TRL's forward replaced by those current-policy log-probs
    (for weights that were not saved). Returns (loss, TRL log-probs of the first micro-batch)."""
    import torch
    if per_token_logps is None:
        out = ref.run_case(case)
        return out["loss"], torch.tensor(out["per_token_logps"])
    model = torch.nn.Linear(1, 1).train()  # only .training is read
    trainer = ref.TrainerStandIn(case, model)
    sizes = json.loads(meta.get("micro_batch_sizes", "null")) or [dump["completion_ids"].size(0)]
    mask = dump["completion_mask"].to(torch.int64)
    tool_mask = dump["env_mask"].to(torch.int64) if "env_mask" in dump else None  # multi-turn
    num_items = torch.tensor(float((mask if tool_mask is None else mask * tool_mask).sum()))
    total, start = 0.0, 0
    for b in sizes:
        sl = slice(start, start + b)
        lp = per_token_logps[sl].float().clone().requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = \
            lambda *a, _lp=lp, **k: (_lp, torch.zeros_like(_lp), None)
        inputs = {"prompt_ids": dump["prompt_ids"][sl].long(), "prompt_mask": dump["prompt_mask"][sl].long(),
                  "completion_ids": dump["completion_ids"][sl].long(), "completion_mask": mask[sl],
                  "advantages": dump["advantages"][sl].float(), "num_items_in_batch": num_items}
        if tool_mask is not None:
            inputs["tool_mask"] = tool_mask[sl]
        if "old_logprobs" in dump:
            inputs["old_per_token_logps"] = dump["old_logprobs"][sl].float()
        total += float(trainer._compute_loss(model, inputs))
        start += b
    return total, per_token_logps[:sizes[0]]


def check_loss_agreement(work, verbose=True, rtol=1e-4, atol=1e-5):
    """Our learner on the demo task (tiny model, num_iterations 2, so step 2 trains on old
    log-probs of the weights before step 1: ratios != 1, clipping) writes batch dumps; TRL's
    _compute_loss on the same batches must give the same loss. Uses
    tests/reference/trl_grpo_ref.py when present, else a GRPOTrainer built here.
    Returns (passed, failed, rows)."""
    torch = setup_torch()
    model_dir = init_model("tiny", os.path.join(work, "loss-model"), seed=3)
    dump_dir = os.path.join(work, "loss-dumps")
    job = grpo_job_config(2)
    job["num_iterations"] = 2
    args = ["train-local", "--json", "--model_name_or_path", model_dir,
            "--output_dir", os.path.join(work, "loss-out"), "--save_steps", "0",
            "--dump_batches_dir", dump_dir, "--importance_sampling_correction", "none",
            "--target_length", str(TARGET_LENGTH)]
    for k, v in job.items():
        args += ["--" + k, str(v)]
    run_grpo(args)
    quiet_libs()
    ref = import_trl_grpo_ref()
    trainer = None if ref is not None else \
        make_trl_trainer(model_dir, job, os.path.join(work, "loss-trl"))
    results = []

    def record(name, ok, detail):
        results.append((name, ok, detail))
        if verbose:
            print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    for step in (1, 2):
        path = os.path.join(dump_dir, f"step-{step:08d}.safetensors")
        dump, meta = load_dump(path)
        ours = json.loads(meta["metrics"])["loss"]
        sizes = json.loads(meta.get("micro_batch_sizes", "null")) or [dump["completion_ids"].size(0)]
        case = {"model_dir": model_dir, "dump": path, "loss_type": job["loss_type"],
                "beta": job["beta"], "epsilon": job["epsilon"],
                "max_completion_length": job["max_completion_length"],
                "temperature": job["temperature"], "gradient_accumulation_steps": len(sizes),
                "per_device_train_batch_size": sizes[0], "position_ids": "trl",
                "grad_norm": False}
        current = None if step == 1 else dump["logprobs"]
        if ref is not None:
            trl, trl_lp = ref_loss_on_dump(ref, case, dump, meta, per_token_logps=current)
        else:
            trl, trl_lp = trl_loss_on_dump(trainer, dump, meta, per_token_logps=current)
        if step == 1:
            # Same weights (the initial model): TRL's own forward, TRL's position ids.
            n = trl_lp.size(0)
            mask = dump["completion_mask"][:n].float() > 0
            d = (trl_lp - dump["logprobs"][:n].float()).abs()[mask].max().item()
            record("step 1 per-token log-probs (TRL forward vs ours)", d < 1e-4,
                   f"max |diff| {d:.2e} over {int(mask.sum())} tokens")
        else:
            # Weights after step 1 are not saved: TRL's loss on our current-policy log-probs.
            ratio = torch.exp(dump["logprobs"] - dump["old_logprobs"])
            m = dump["completion_mask"].float() > 0
            d = (ratio[m] - 1).abs().max().item()
            record("step 2 batch is off-policy (non-trivial ratios)", d > 1e-3,
                   f"max |ratio - 1| {d:.3g}")
        ok = abs(trl - ours) <= atol + rtol * abs(trl)
        record(f"step {step} loss (ours vs TRL _compute_loss"
               f"{', tests/reference/trl_grpo_ref.py' if ref else ''})", ok,
               f"ours {ours:.8f} TRL {trl:.8f} |diff| {abs(trl - ours):.2e}")
    passed = sum(1 for r in results if r[1])
    return passed, len(results) - passed, results


# ---------------------------------------------------------------------------------------------
# End-to-end: the demo task.

def moving_threshold(times, rewards, thr, window):
    for k in range(len(rewards)):
        w = rewards[max(0, k - window + 1):k + 1]
        if len(w) == window and sum(w) / window >= thr:
            return times[k], k + 1
    return None, None


def e2e_args(command, model_dir, out_dir, job, micro_batch_threads):
    """`grpo <command>` (train-local or demo) on the demo task with the job's keys, as TRL runs
    it: no checkpoints, no importance-sampling correction (TRL has none without vLLM)."""
    args = [command, "--json", "--model_name_or_path", model_dir, "--output_dir", out_dir,
            "--save_steps", "0", "--importance_sampling_correction", "none",
            "--target_length", str(TARGET_LENGTH), "--micro_batch_threads",
            str(micro_batch_threads)]
    for k, v in job.items():
        args += ["--" + k, str(v)]
    return args


def run_ours_e2e(model_dir, job, work, threads=None, micro_batch_threads=1):
    """grpo train-local; `threads` intra-op threads (default THREADS) and `micro_batch_threads`
    micro-batches trained at once (README "The learner's memory and speed")."""
    threads = threads or THREADS
    args = e2e_args("train-local", model_dir,
                    os.path.join(work, f"e2e-ours-t{threads}-m{micro_batch_threads}"), job,
                    micro_batch_threads)
    t0 = time.perf_counter()
    p = subprocess.Popen([GRPO_BIN] + args, env=ours_env(threads), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    times, rewards, step_s, gen_s = [], [], [], []
    for line in p.stdout:
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if "reward" in j and "step" in j:
            times.append(time.perf_counter() - t0)
            rewards.append(j["reward"])
            gen_s.append(j.get("generation_seconds", 0.0))
            step_s.append(j.get("step_seconds", 0.0))
    err = p.stderr.read()
    if p.wait() != 0:
        raise RuntimeError("grpo train-local failed:\n" + err[-3000:])
    # The clock TRL's figures run on (from on_train_begin: the model loaded, nothing generated
    # yet): train-local's first step began its generation_seconds + step_seconds before its line.
    train0 = times[0] - (gen_s[0] + step_s[0])
    return {"times": times, "rewards": rewards, "gen_s": sum(gen_s) / len(gen_s),
            "train_s": sum(step_s) / len(step_s), "times_from_train": [t - train0 for t in times],
            "threads": threads, "micro_batch_threads": micro_batch_threads}


def run_ours_services_e2e(model_dir, job, work, workers, threads, micro_batch_threads=1):
    """The distributed system on this machine: `grpo demo` (a learner and `workers` rollout
    workers as processes on loopback, async with max_staleness 1, the demo's set-up) on the same
    task, model, config and seed; `threads` intra-op threads per process, and the learner's
    `micro_batch_threads`. Times from the start of `grpo demo`, as run_ours_e2e's from the
    start of train-local."""
    args = e2e_args("demo", model_dir,
                    os.path.join(work, f"services-w{workers}-t{threads}-m{micro_batch_threads}"),
                    job, micro_batch_threads) + ["--workers", str(workers)]
    t0 = time.perf_counter()
    p = subprocess.Popen([GRPO_BIN] + args, env=ours_env(threads), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    times, rewards, summary = [], [], None
    for line in p.stdout:
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j.get("summary"):
            summary = j
        elif "reward" in j and "step" in j:
            times.append(time.perf_counter() - t0)
            rewards.append(j["reward"])
    err = p.stderr.read()
    if p.wait() != 0 or not times or summary is None:
        raise RuntimeError("grpo demo failed:\n" + err[-3000:])
    # The clock TRL's figures run on (from on_train_begin: the model loaded, nothing generated
    # yet): the job's submission, train_seconds (submission to the end of the demo's watch,
    # just after the last step's line) before the last step's line; a little early, so the
    # figure on this clock is a little low.
    submitted = times[-1] - summary["train_seconds"]
    return {"times": times, "rewards": rewards, "workers": workers, "threads": threads,
            "micro_batch_threads": micro_batch_threads,
            "times_from_train": [t - submitted for t in times]}


def steady_steps_per_s(times):
    """Optimizer steps per second after the first step (start-up and the first batch left out)."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None


def run_trl_e2e(model_dir, job, work):
    from transformers import TrainerCallback
    trainer = make_trl_trainer(model_dir, job, os.path.join(work, "e2e-trl"))
    rec = {"times": [], "rewards": [], "t0": None}

    class Rec(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            rec["t0"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rec["times"].append(time.perf_counter() - rec["t0"])
                rec["rewards"].append(float(logs["reward"]))

    trainer.add_callback(Rec())
    gen_t = []
    orig = trainer._generate_and_score_completions

    def timed(*a, **k):  # generation + scoring + advantages, once per generation batch
        t = time.perf_counter()
        out = orig(*a, **k)
        gen_t.append(time.perf_counter() - t)
        return out
    trainer._generate_and_score_completions = timed
    trainer.train()
    n = len(rec["times"])
    rec["gen_s"] = sum(gen_t) / n
    rec["train_s"] = (rec["times"][-1] - sum(gen_t)) / n  # the rest of each step
    return rec


def text_plot(curves, width=60, height=12):
    """curves: {label_char: [y...]} on one scale; one column per bucket of steps."""
    n = max(len(v) for v in curves.values())
    cols = min(width, n)

    def bucket(y):
        out = []
        for c in range(cols):
            b, e = len(y) * c // cols, max(len(y) * c // cols + 1, len(y) * (c + 1) // cols)
            seg = y[b:e]
            out.append(sum(seg) / len(seg) if seg else None)
        return out
    b = {k: bucket(v) for k, v in curves.items()}
    vals = [x for v in b.values() for x in v if x is not None]
    lo, hi = min(vals), max(vals)
    span = hi - lo if hi > lo else 1.0
    lines = []
    for r in range(height - 1, -1, -1):
        row = []
        for c in range(cols):
            ch = " "
            for k, v in b.items():
                if v[c] is not None and round((v[c] - lo) / span * (height - 1)) == r:
                    ch = k if ch == " " else "*"
            row.append(ch)
        lines.append(f"{lo + span * r / (height - 1):9.2f} |" + "".join(row))
    lines.append(" " * 10 + "+" + "-" * cols)
    lines.append(" " * 11 + f"step 1{' ' * max(0, cols - 12)}{n}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Generation, learner step, memory.

def timeit(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts)}


GEN_PROMPTS, GEN_G = 4, 16  # the generation batch: 4 demo prompts x 16 completions


def ours_generation(model_dir, reps, new_tokens, work):
    """Our rollout engine on the generation batch, inside grpo train-local (learning_rate 0, so
    every batch is sampled from the same weights): generation_seconds and completion_tokens of
    each generation batch; the first batch is the warm-up."""
    args = ["train-local", "--json", "--model_name_or_path", model_dir,
            "--output_dir", os.path.join(work, "gen-ours"), "--save_steps", "0",
            "--max_steps", str(reps + 1), "--num_generations", str(GEN_G),
            "--prompts_per_step", str(GEN_PROMPTS), "--per_device_train_batch_size", str(GEN_G),
            "--gradient_accumulation_steps", str(GEN_PROMPTS), "--max_completion_length",
            str(new_tokens), "--learning_rate", "0", "--importance_sampling_correction", "none",
            "--temperature", "1.0", "--top_k", "0", "--top_p", "1.0", "--seed", "1"]
    steps = [j for j in json_lines(run_grpo(args).stdout) if "generation_seconds" in j][1:]
    tps = [j["completion_tokens"] / j["generation_seconds"] for j in steps]
    secs = [j["generation_seconds"] for j in steps]
    return {"tokens_per_s": statistics.median(tps), "median": statistics.median(secs),
            "min": min(secs), "max": max(secs),
            "tokens": statistics.median(j["completion_tokens"] for j in steps)}


def trl_generation(model_dir, reps, new_tokens):
    """model.generate with the GenerationConfig GRPOTrainer builds (sampling, temperature 1,
    top_k 0, top_p 1, EOS from the tokenizer, pad), on the same batch: the 4 demo prompts
    tokenized as GRPOTrainer does (left padding), each repeated 16 times as TRL repeats them.
    Tokens counted up to and including EOS, as ours."""
    torch = setup_torch()
    quiet_libs()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    enc = tok([chat_prompt(q) for q in DEMO_QUESTIONS[:GEN_PROMPTS]], return_tensors="pt",
              padding=True, padding_side="left", add_special_tokens=False)
    ids = enc["input_ids"].repeat_interleave(GEN_G, 0)
    att = enc["attention_mask"].repeat_interleave(GEN_G, 0)
    eos = tok.eos_token_id
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                          top_k=0, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, disable_compile=True)
    tps, secs, toks = [], [], []
    for r in range(reps + 1):  # the first is the warm-up
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, generation_config=gc)
        dt = time.perf_counter() - t
        c = out[:, ids.size(1):]
        is_eos = c == eos
        lens = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1,
                           torch.full((c.size(0),), c.size(1)))
        if r > 0:
            n = int(lens.sum())
            tps.append(n / dt)
            secs.append(dt)
            toks.append(n)
    return {"tokens_per_s": statistics.median(tps), "median": statistics.median(secs),
            "min": min(secs), "max": max(secs), "tokens": statistics.median(toks)}


def trl_learner_step(model_dir, reps, micro=4, G=16):
    """One optimizer step of TRL on a prepared batch: G sequences of 64 + 128 tokens in G/micro
    micro-batches through trainer.training_step (forward, loss, backward), then gradient clipping,
    AdamW step and zero_grad, as Trainer's loop does."""
    torch = setup_torch()
    job = grpo_job_config(1)
    job.update(num_generations=G, per_device_train_batch_size=micro,
               gradient_accumulation_steps=G // micro, max_completion_length=COMPLETION_LEN)
    work = tempfile.mkdtemp(prefix="peer_trl_ls_")
    trainer = make_trl_trainer(model_dir, job, work)
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    model = trainer.model
    model.train()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (G, PROMPT_LEN + COMPLETION_LEN), generator=g)
    adv = torch.tensor([float(j % 4) for j in range(G)])
    adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    batches = []
    for b0 in range(0, G, micro):
        x = ids[b0:b0 + micro]
        batches.append({"prompt_ids": x[:, :PROMPT_LEN], "prompt_mask": torch.ones(micro, PROMPT_LEN, dtype=torch.long),
                        "completion_ids": x[:, PROMPT_LEN:],
                        "completion_mask": torch.ones(micro, COMPLETION_LEN),
                        "advantages": adv[b0:b0 + micro],
                        "num_items_in_batch": torch.tensor(float(G * COMPLETION_LEN))})
    trainer.current_gradient_accumulation_steps = len(batches)
    cur = {}
    trainer._prepare_inputs = lambda _inputs: cur["b"]
    opt = trainer.optimizer

    def step():
        for b in batches:
            cur["b"] = b
            trainer.training_step(model, b, b["num_items_in_batch"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    t = timeit(step, reps)
    t["tokens_per_s"] = G * (PROMPT_LEN + COMPLETION_LEN) / t["median"]
    return t


def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child_trl_memory(model_dir, G):
    """One fresh process: TRL's _compute_loss + backward on G sequences (one group, one
    micro-batch of G as TRL's per_device_train_batch_size = G), 64 + 128 tokens. Peak = VmHWM
    after the second step minus VmRSS after the first (model and gradients exist), as grpo bench
    logprob_memory measures ours."""
    torch = setup_torch()
    job = grpo_job_config(1)
    job.update(num_generations=G, per_device_train_batch_size=G, gradient_accumulation_steps=1,
               max_completion_length=COMPLETION_LEN)
    trainer = make_trl_trainer(model_dir, job, tempfile.mkdtemp(prefix="peer_trl_mem_"))
    model = trainer.model
    model.train()
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (G, PROMPT_LEN + COMPLETION_LEN), generator=gen)
    inputs = {"prompt_ids": ids[:, :PROMPT_LEN], "prompt_mask": torch.ones(G, PROMPT_LEN, dtype=torch.long),
              "completion_ids": ids[:, PROMPT_LEN:], "completion_mask": torch.ones(G, COMPLETION_LEN),
              "advantages": torch.randn(G, generator=gen),
              "num_items_in_batch": torch.tensor(float(G * COMPLETION_LEN))}
    trainer.current_gradient_accumulation_steps = 1

    def step():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        trainer._compute_loss(model, inputs).backward()
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = proc_status_bytes("VmRSS")
    t = time.perf_counter()
    step()
    dt = time.perf_counter() - t
    peak = proc_status_bytes("VmHWM") - base
    print(json.dumps({"G": G, "peak_mib": peak / 1048576.0, "step_s": dt}))


# ---------------------------------------------------------------------------------------------

def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    ap.add_argument("--fast", action="store_true", help="tiny model end to end, fewer steps")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    ap.add_argument("--steps", type=int, default=0, help="end-to-end optimizer steps per side")
    ap.add_argument("--e2e-rounds", type=positive_int, default=3,
                    help="end-to-end rounds (both sides and every services layout each round; "
                         "medians reported)")
    ap.add_argument("--G", type=int, nargs="+", default=None,
                    help="memory rows (default 4 8 16 32 64; --fast: 4 16 64)")
    ap.add_argument("--threshold", type=float, default=-6.0,
                    help="reward threshold (moving mean over 5 steps) for time-to-threshold")
    ap.add_argument("--e2e-model", choices=["tiny", "bench"], default=None,
                    help="end-to-end model (default: tiny with --fast, else bench)")
    ap.add_argument("--check-loss-agreement", action="store_true")
    ap.add_argument("--child-trl-memory", type=int, default=0)
    ap.add_argument("--model", default="")
    a = ap.parse_args()

    if a.child_trl_memory:
        child_trl_memory(a.model, a.child_trl_memory)
        return 0

    work = tempfile.mkdtemp(prefix="peer_trl_")
    if a.check_loss_agreement:
        passed, failed, _ = check_loss_agreement(work)
        print(f"{passed} passed, {failed} failed")
        return 0 if failed == 0 else 1

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else \
        (lambda *x: print(*x, flush=True))
    real_stdout = sys.stdout
    if a.json:
        sys.stdout = sys.stderr  # only the rows go to stdout
    torch = setup_torch()
    import transformers
    import trl
    steps = a.steps or (40 if a.fast else 60)
    a.G = a.G or ([4, 16, 64] if a.fast else [4, 8, 16, 32, 64])
    e2e_preset = a.e2e_model or ("tiny" if a.fast else "bench")
    e2e_model = init_model(e2e_preset, os.path.join(work, "model-" + e2e_preset))
    bench_model = init_model("bench", os.path.join(work, "model-bench"))
    job = grpo_job_config(steps)
    # GRPO_OMP_DEFAULTS: the values are grpo's own (set by `grpo bench`), which a serving
    # command (the demo's learner and workers) replaces with its own (services/cli/launch.cc).
    omp = "" if "GRPO_OMP_DEFAULTS" in os.environ else " ".join(
        f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        if k in os.environ)
    omp = omp or ("grpo's OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT "
                                           "300000 (train-local, bench) or 0 (demo's services)")
    settings = {"threads": THREADS, "ours": f"OMP_NUM_THREADS={THREADS}, {omp}, fp32",
                "trl": f"torch.set_num_threads({THREADS}), fp32, use_cpu, bf16 False, "
                       "gradient_checkpointing False, transformers generate (no vLLM)",
                "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                            f"trl {trl.__version__}",
                "e2e_model": e2e_preset, "job": job,
                "ours_extra": "importance_sampling_correction none (TRL has none without vLLM)",
                "reps": a.reps, "e2e_rounds": a.e2e_rounds}
    rows = []
    t_run = time.perf_counter()
    _log = log

    def log(*x):
        _log(f"[{time.perf_counter() - t_run:6.1f} s]", *x)

    def row(metric, ours, trl_v, unit, better, **extra):
        r = {"bench": "peer_trl", "metric": metric, "ours": ours, "trl": trl_v,
             "ratio": (ours / trl_v) if (ours is not None and trl_v) else None,
             "unit": unit, "better": better}
        r.update(extra)
        rows.append(r)

    # 1. loss agreement
    log("[peer_trl] loss agreement ...")
    passed, failed, _ = check_loss_agreement(os.path.join(work), verbose=not a.json)
    row("loss_agreement_checks_passed", passed, passed + failed, "checks", "higher",
        failed=failed)

    # 2. end to end: `--e2e-rounds` rounds, each running train-local, TRL's trainer and the
    # services at every layout back to back (this VM's speed drifts by tens of per cent within
    # minutes, and not alike for both sides); each figure is the median over the rounds, and
    # each ratio row carries every round's own ratio.
    log(f"[peer_trl] end to end: demo task, {e2e_preset} model, {steps} steps per side, "
        f"{a.e2e_rounds} rounds ...")
    # The services at each thread layout (workers x intra-op threads per process, and with two
    # or more threads one worker beside a learner of one intra-op thread and two micro-batches
    # at once: the worker decodes while the learner trains); the best.
    layouts = [(w, t, 1) for w in (1, 2) for t in sorted({1, THREADS})]
    if THREADS >= 2:
        layouts.append((1, 1, 2))
    rounds = []
    for i in range(a.e2e_rounds):
        round_work = os.path.join(work, f"e2e-round-{i + 1}")  # fresh output dirs: no resume
        os.makedirs(round_work)
        # train-local at each layout: THREADS intra-op threads, and with two or more cores also
        # one intra-op thread and two micro-batches at once; the best.
        ours_runs = [run_ours_e2e(e2e_model, job, round_work)]
        if THREADS >= 2:
            ours_runs.append(run_ours_e2e(e2e_model, job, round_work, threads=1,
                                          micro_batch_threads=2))
        trl_r = run_trl_e2e(e2e_model, job, round_work)
        log(f"[peer_trl]   round {i + 1}: services (grpo demo), layouts (workers, threads, "
            f"micro-batches at once) {layouts} ...")
        services_runs = [run_ours_services_e2e(e2e_model, job, round_work, w, t, m)
                         for w, t, m in layouts]
        trl_r["times_from_train"] = trl_r["times"]  # from its on_train_begin already
        for r in ours_runs + [trl_r] + services_runs:
            r["steps_per_s"] = len(r["times"]) / r["times"][-1]
            r["steps_per_s_from_train"] = len(r["times"]) / r["times_from_train"][-1]
            r["thr_s"], r["thr_step"] = moving_threshold(r["times"], r["rewards"], a.threshold, 5)
            k = max(1, min(10, len(r["rewards"]) // 3))
            r["first"] = sum(r["rewards"][:k]) / k
            r["last"] = sum(r["rewards"][-k:]) / k
            r["steady"] = steady_steps_per_s(r["times"])
        ours_r = max(ours_runs, key=lambda r: r["steps_per_s"])
        ours_r["layouts"] = {f"t{r['threads']}_m{r['micro_batch_threads']}": r["steps_per_s"]
                             for r in ours_runs}
        services_r = max(services_runs, key=lambda r: r["steps_per_s"])
        services_r["layouts"] = {f"w{r['workers']}_t{r['threads']}_m{r['micro_batch_threads']}":
                                 r["steps_per_s"] for r in services_runs}
        rounds.append({"ours": ours_r, "trl": trl_r, "services": services_r})

    def med(side, key):
        values = [r[side][key] for r in rounds if r[side][key] is not None]
        return statistics.median(values) if values else None

    def round_ratios(side, key="steps_per_s"):
        return [r[side][key] / r["trl"][key] for r in rounds]
    ours_e2e, trl_e2e = rounds[0]["ours"], rounds[0]["trl"]  # the curves of round 1
    services_e2e = rounds[0]["services"]
    row("e2e_steps_per_s", med("ours", "steps_per_s"), med("trl", "steps_per_s"), "steps/s",
        "higher", steps=steps, model=e2e_preset, rounds=a.e2e_rounds,
        round_ratios=round_ratios("ours"), round_layouts=[r["ours"]["layouts"] for r in rounds],
        note="train-local at its best layout of each round: t<intra-op threads>_m<micro-batches "
             "at once> (m2 with two or more threads)")
    row("e2e_steps_per_s_from_train_start", med("ours", "steps_per_s_from_train"),
        med("trl", "steps_per_s_from_train"), "steps/s", "higher",
        round_ratios=round_ratios("ours", "steps_per_s_from_train"),
        note="both on TRL's clock (on_train_begin: model loaded): ours from the start of "
             "train-local's first generation, not from the process's start")
    row("e2e_time_to_threshold_s", med("ours", "thr_s"), med("trl", "thr_s"), "s", "lower",
        threshold=a.threshold, ours_step=med("ours", "thr_step"), trl_step=med("trl", "thr_step"))
    row("e2e_generation_s_per_step", med("ours", "gen_s"), med("trl", "gen_s"), "s", "lower",
        note="ours: generation_seconds; TRL: _generate_and_score_completions")
    row("e2e_train_s_per_step", med("ours", "train_s"), med("trl", "train_s"), "s", "lower",
        note="ours: step_seconds; TRL: step wall time minus generation")
    row("e2e_reward_first", med("ours", "first"), med("trl", "first"), "reward", "higher")
    row("e2e_reward_last", med("ours", "last"), med("trl", "last"), "reward", "higher")
    row("services_e2e_steps_per_s", med("services", "steps_per_s"), med("trl", "steps_per_s"),
        "steps/s", "higher", steps=steps, model=e2e_preset, rounds=a.e2e_rounds,
        round_ratios=round_ratios("services"),
        round_layouts=[r["services"]["layouts"] for r in rounds],
        steady_steps_per_s=[med("services", "steady"), med("trl", "steady")],
        steady_round_ratios=round_ratios("services", "steady"),
        note="grpo demo: learner + workers as processes on loopback, max_staleness 1, the best "
             "layout of each round (w<workers>_t<intra-op threads>_m<the learner's "
             "micro-batches at once>); steady_steps_per_s [ours, TRL] leaves out start-up and the "
             "first step")
    row("services_e2e_steps_per_s_from_job_start", med("services", "steps_per_s_from_train"),
        med("trl", "steps_per_s_from_train"), "steps/s", "higher",
        round_ratios=round_ratios("services", "steps_per_s_from_train"),
        note="both on TRL's clock (on_train_begin: model loaded): ours from the job's "
             "submission (the learner serving, workers started beside it), not from the demo's "
             "start")
    row("services_e2e_time_to_threshold_s", med("services", "thr_s"), med("trl", "thr_s"), "s",
        "lower", threshold=a.threshold, ours_step=med("services", "thr_step"),
        trl_step=med("trl", "thr_step"))
    row("services_e2e_reward_first", med("services", "first"), med("trl", "first"), "reward",
        "higher")
    row("services_e2e_reward_last", med("services", "last"), med("trl", "last"), "reward",
        "higher")

    # 3. generation
    gen_tokens = 32 if a.fast else COMPLETION_LEN
    log(f"[peer_trl] generation: bench model, {GEN_PROMPTS} demo prompts x {GEN_G}, "
        f"{gen_tokens} new tokens ...")
    og = ours_generation(bench_model, a.reps, gen_tokens, work)
    tg = trl_generation(bench_model, a.reps, gen_tokens)
    row("generation_tokens_per_s", og["tokens_per_s"], tg["tokens_per_s"], "tokens/s",
        "higher", new_tokens=gen_tokens, ours_s=[og["median"], og["min"], og["max"]],
        trl_s=[tg["median"], tg["min"], tg["max"]], ours_tokens=og["tokens"], trl_tokens=tg["tokens"])

    # 4. learner step
    log("[peer_trl] learner step: bench model, G=16 x (64 + 128), micro-batch 4 ...")
    ls = json_lines(run_grpo(["bench", "learner_step", "--json", "--reps", str(a.reps)]).stdout)[0]
    tl = trl_learner_step(bench_model, a.reps)
    row("learner_step_s", ls["step_s_median"], tl["median"], "s", "lower",
        ours_min_max=[ls["step_s_min"], ls["step_s_max"]], trl_min_max=[tl["min"], tl["max"]],
        speedup=tl["median"] / ls["step_s_median"])

    # 5. memory vs G
    log(f"[peer_trl] peak learner memory, G in {a.G} (fresh process each) ...")
    ours_mem, trl_mem = {}, {}
    for G in a.G:
        # One configuration of grpo bench logprob_memory (its "chunked" row: the learner's fused
        # path at micro-batch 4), in its own fresh process, as the bench runs each.
        # Median of 3 fresh processes: ours is ~100-200 MiB, where allocator noise is tens of MiB.
        ours_mem[G] = statistics.median(
            json_lines(run_grpo(["bench", "logprob_memory", "--child", "--impl", "chunked", "--G",
                                 str(G), "--micro_batch", "4", "--reps", "1"]).stdout)[0]["peak_mib"]
            for _ in range(3))
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-trl-memory", str(G),
                            "--model", bench_model], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"TRL memory child G={G} failed:\n{p.stderr[-3000:]}")
        trl_mem[G] = json_lines(p.stdout)[-1]["peak_mib"]
        row(f"peak_mib_G{G}", ours_mem[G], trl_mem[G], "MiB", "lower", G=G)
    g0, g1 = a.G[0], a.G[-1]
    row(f"peak_mib_G{g1}_over_G{g0}", ours_mem[g1] / ours_mem[g0], trl_mem[g1] / trl_mem[g0],
        "ratio", "lower")

    log("[peer_trl] done")
    settings["run_seconds"] = round(time.perf_counter() - t_run, 1)
    # Report
    sys.stdout = real_stdout
    if a.json:
        print(json.dumps({"bench": "peer_trl", "metric": "settings", **settings}))
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"bench": "peer_trl", "metric": "reward_curves",
                          "ours": ours_e2e["rewards"], "trl": trl_e2e["rewards"],
                          "services": services_e2e["rewards"],
                          "ours_times": ours_e2e["times"], "trl_times": trl_e2e["times"],
                          "services_times": services_e2e["times"]}))
        return 0 if failed == 0 else 1
    print("\npeer_trl: grpo-serve vs TRL, same machine, same run; ratio = ours / TRL")
    for k, v in settings.items():
        print(f"  {k}: {v}")
    print(f"\n{'metric':34}{'ours':>12}{'TRL':>12}{'ratio':>9}  unit (better)")

    def fmt(x):
        return "-" if x is None else (f"{x:12.4g}" if isinstance(x, float) else f"{x:12}")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['metric']:34}{fmt(r['ours']):>12}{fmt(r['trl']):>12}{ratio:>9}  "
              f"{r['unit']} ({r['better']})")
    print(f"\nreward per step (o = ours, t = TRL, * = both), {steps} steps, threshold {a.threshold}")
    print(text_plot({"o": ours_e2e["rewards"], "t": trl_e2e["rewards"]}))
    print(f"\nreward per step through the services (s = grpo demo, t = TRL, * = both)")
    print(text_plot({"s": services_e2e["rewards"], "t": trl_e2e["rewards"]}))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    import shutil
    _tmp_before = set(os.listdir(tempfile.gettempdir()))
    try:
        rc = main()
    finally:  # the work folders this run made (models, dumps, checkpoints)
        for name in set(os.listdir(tempfile.gettempdir())) - _tmp_before:
            if name.startswith("peer_trl_"):
                shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)
    sys.exit(rc)
