#!/usr/bin/env python3
"""Runs the measurements behind docs/results.md, docs/planner.md and docs/cost-model.md.

    scripts/run-results.py [--build build] [--out docs/data] [SECTION ...]

Each section runs its commands and writes one JSON file per measurement into --out (default
docs/data/): the benchmarks' own `--json` reports, and for CLI commands and Python jobs the
same envelope (commit, cores, load average at start and end, UTC time) around their output.
Then `scripts/render-results.py` rewrites the tables in the docs from those files.

Sections (default: all of them, in this order; about 30 minutes on a 2-core machine):
  policy          parapilot eval on the six families (deterministic: any machine load)
  holdout         parapilot eval on experiments/scenarios/holdout/, never trained on (deterministic)
  information     the rules again with exact beliefs (beliefs=exact): what a perfect estimator buys
  training        parapilot train, the shipped policy's recipe: the validation curve against wall time
  policy-latency  bench_policy
  planner         bench_planner, bench_env, bench_cost_model
  calibration     calibration_report: the cost model on the published runs (deterministic)
  deploy-sim      bench_deploy straggler (64 and 256 ranks) and latency (1024 ranks, 3 runs)
  deploy-scale    bench_deploy latency beside 16,384 (3 runs) and 65,536 simulated ranks (200
                  steps of 200 ms; a size the machine cannot connect is recorded as not run, with
                  why)
  transport       bench_transport: the bus against ZeroMQ PUSH/PULL, 1, 16 and 256 publishers
  deploy-live     bench_closed_loop, 3 rounds, the shipped policy and reactive
  pytorch         the PyTorch job test (its JSON lines) and the per-step overhead example
  pytorch-matrix  the job-shape matrix (ctest -L matrix -LE torch2, its JSON lines; about 10 minutes)
  pytorch-policies  deploy's policies on a real PyTorch job, 5 interleaved rounds
                  (benchmarks/live/pytorch_policies.py; about 20 minutes)
  fsdp            an FSDP2 job on devices of speeds 1, 1, 1/2, 1/3 with and without deploy, and the
                  sum-of-speeds bound, 3 rounds (benchmarks/live/fsdp_mixed.py under the torch 2.x
                  Python; about 5 minutes)
  live            bench_live elastic and compression
  live-layouts    one training job under six layouts: final loss and parameters against dp=4
  live-switch     bench_switch pause, slowed and staging (about 6 minutes)
  pipeline-switch  a parapilot.pipeline job's live block move against a restart, under torch 2.x
                  (benchmarks/live/pipeline_switch.py; about 2 minutes)
  pipeline-slow   a pipeline job with a stage slowed part way: deploy, no agent, the best static
                  split (benchmarks/live/pipeline_slow.py; about 5 minutes)
  netns           compression on 200 Mbit/s and unlimited links between network-namespace
                  hosts, 3 rounds (benchmarks/live/netns_compression.py; root; about 3 minutes)
  netns-congestion  one host's link limited to 50 Mbit/s part way through a DDP job, with deploy
                  (shipped defaults) and without, 3 repetitions, and one run whose link recovers
                  (benchmarks/live/netns_congestion.py; root; about 3 minutes)

Timed sections want a quiet machine: run nothing else meanwhile. The load average each
measurement saw is in its file, and the rendered tables quote it.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch 2.x (scripts/install-torch2.sh): parapilot.pipeline needs torch >= 2.4.
TORCH2_PYTHON = os.environ.get("PARAPILOT_TORCH2_PYTHON", "/opt/parapilot/torch2/bin/python")
FAMILIES = ["hetero", "straggler", "congestion", "failure", "phase", "mixed"]
POLICIES = "rl,static,reactive,reactive-tuned,threshold,ski-rental,lookahead,uniform-dp,oracle"
# The shipped policy's training run (docs/policy.md, "The shipped policy").
TRAINING_ARGS = ["--scenario",
                 "experiments/scenarios/train,random*4,dp:random(horizon=96)*8,"
                 "sim:failslow(horizon=96)*2,pp:random(horizon=96)*2",
                 "--envs", "29", "--steps", "2150000", "--seed", "1", "--validation-episodes", "6",
                 "--validate-every", "20", "--switch-penalty", "0.003"]
# The step-granular families: the data-parallel job simulator's, and its held-out draws (the
# training distribution on eval's seeds, and jobs outside its ranges: 128 ranks; 5 steps per
# decision); the hybrid simulator's fail-slow family and its 70B file; the pipeline job
# simulator's families (blocks per stage, the same decision core).
DP_ENVS = {"straggler": "dp:straggler", "comm": "dp:comm", "flap": "dp:flap", "mixed": "dp:mixed",
           "random": "dp:random", "random, 128 ranks": "dp:random(ranks=128)",
           "random, 5 steps per decision": "dp:random(decision_steps=5)",
           "failslow": "sim:failslow",
           "failslow-70b": "experiments/scenarios/failslow-70b.toml",
           "pp straggler": "pp:straggler", "pp comm": "pp:comm", "pp flap": "pp:flap",
           "pp mixed": "pp:mixed", "pp random": "pp:random"}
# measured-shares as deploy runs it, and tuned on the dp: training seeds
# (build/benchmarks/policy/tune_rules measured-shares --episodes 40).
DP_TUNED = "measured-shares(min_gain=1.15,confirm=1)"
DP_POLICIES = ("rl,measured-shares,%s,reactive,reactive-tuned,threshold,ski-rental,static,oracle"
               % DP_TUNED)
# The rules that read beliefs, for the information section (static and uniform-dp do not).
RULES_READING_BELIEFS = "reactive,reactive-tuned,threshold,ski-rental,lookahead,oracle"
SECTIONS = ["policy", "holdout", "dp", "information", "training", "policy-latency", "planner", "calibration",
            "deploy-sim", "deploy-scale", "transport", "deploy-live", "pytorch", "pytorch-matrix",
            "pytorch-policies", "fsdp", "live", "live-layouts", "live-switch", "pipeline-switch",
            "pipeline-slow", "netns", "netns-congestion"]


def git(*args):
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def envelope(name, args):
    """The same head a benchmark's --json report has (benchmarks/report.h)."""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # docs/data is what the run writes: results already written are not a change to the code.
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/data"):
        commit += "-dirty"
    return {"benchmark": name, "args": args, "commit": commit, "cores": os.cpu_count(),
            "load_average": {"start": list(os.getloadavg())},
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def finish(report, figures, path):
    report["load_average"]["end"] = list(os.getloadavg())
    report["figures"] = figures
    write_json(path, report)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def run(cmd, check=True, **kw):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=ROOT, **kw)
    if check and r.returncode != 0:
        sys.exit("failed (exit %d): %s" % (r.returncode, " ".join(cmd)))
    return r


class Runner:
    def __init__(self, build, out):
        self.build = os.path.abspath(build)
        self.out = os.path.abspath(out)
        self.training_run = None
        os.makedirs(self.out, exist_ok=True)

    def bin(self, *parts):
        return os.path.join(self.build, *parts)

    def path(self, name):
        return os.path.join(self.out, name)

    def bench(self, name, cmd):
        """A benchmark with its own --json report."""
        run(cmd + ["--json", self.path(name)])

    def shipped_policy_current(self):
        """eval's `rl` reads the build tree's copy of the shipped policy, refreshed by a build."""
        ours = os.path.join(ROOT, "checkpoints", "default-mixed.ckpt")
        copy = self.bin("share", "parapilot", "default-mixed.ckpt")
        def read(path):
            with open(path, "rb") as f:
                return f.read()
        if not os.path.exists(copy) or read(copy) != read(ours):
            sys.exit("run-results: %s is missing or differs from %s: build first (cmake --build %s)"
                     % (copy, ours, self.build))

    def policy(self):
        self.shipped_policy_current()
        report = envelope("parapilot eval", ["--episodes", "30", "--seed", "1000",
                                             "--policies", POLICIES])
        families = {f: self.eval(f, POLICIES) for f in FAMILIES}
        finish(report, {"families": families}, self.path("policy-eval.json"))

    def holdout_ids(self, params=""):
        """The held-out scenario files and the training distribution's draws, by table name."""
        folder = os.path.join(ROOT, "experiments", "scenarios", "holdout")
        files = sorted(f for f in os.listdir(folder) if f.endswith(".toml"))
        ids = {f[:-len(".toml")]: "sim:" + os.path.join(folder, f) + params for f in files}
        # Draws of the training distribution on seeds training never uses (eval's small seeds;
        # training draws from seeds >= 2^40): 30 clusters, models and dynamics of their own.
        ids["sim:random"] = "sim:random" + params
        return ids

    def eval(self, env_id, policies):
        r = run([self.bin("parapilot"), "eval", "--scenario", env_id, "--episodes", "30",
                 "--seed", "1000", "--policies", policies, "--json"],
                capture_output=True, text=True)
        return json.loads(r.stdout)

    def holdout(self):
        self.shipped_policy_current()
        report = envelope("parapilot eval", ["--episodes", "30", "--seed", "1000",
                                             "--policies", POLICIES])
        scenarios = {name: self.eval(i, POLICIES) for name, i in self.holdout_ids().items()}
        finish(report, {"scenarios": scenarios}, self.path("holdout-eval.json"))

    def dp(self):
        self.shipped_policy_current()
        report = envelope("parapilot eval", ["--episodes", "30", "--seed", "1000",
                                             "--policies", DP_POLICIES])
        envs = {name: self.eval(i, DP_POLICIES) for name, i in DP_ENVS.items()}
        finish(report, {"envs": envs, "ids": DP_ENVS}, self.path("dp-eval.json"))

    def information(self):
        # The same episodes as the policy and holdout sections, the agent believing the truth of
        # the interval just run instead of the monitor's estimate (TelemetryModel::exact_beliefs).
        report = envelope("parapilot eval", ["--episodes", "30", "--seed", "1000",
                                             "--policies", RULES_READING_BELIEFS])
        ids = {f: "sim:%s(beliefs=exact)" % f for f in FAMILIES}
        ids.update(self.holdout_ids("(beliefs=exact)"))
        scenarios = {name: self.eval(i, RULES_READING_BELIEFS) for name, i in ids.items()}
        finish(report, {"scenarios": scenarios}, self.path("information-eval.json"))

    def training(self):
        # The shipped policy's run (docs/policy.md). --training-run DIR keeps the run there
        # (its best.ckpt is what checkpoints/ ships) instead of in a temporary folder.
        args = TRAINING_ARGS
        report = envelope("parapilot train", args)
        with tempfile.TemporaryDirectory() as tmp:
            out = self.training_run or os.path.join(tmp, "run")
            run([self.bin("parapilot"), "train", *args, "--out", out, "--overwrite"])
            with open(os.path.join(out, "metrics.csv")) as f:
                lines = [l.strip().split(",") for l in f if l.strip()]
        head, rows = lines[0], lines[1:]
        table = [dict(zip(head, r)) for r in rows]
        finish(report, {"metrics": table}, self.path("training.json"))

    def policy_latency(self):
        self.bench("policy-latency.json", [self.bin("benchmarks", "policy", "bench_policy")])

    def planner(self):
        self.bench("planner.json", [self.bin("benchmarks", "strategy", "bench_planner"), "5"])
        self.bench("env.json", [self.bin("benchmarks", "env", "bench_env"), "3"])
        self.bench("cost-model.json", [self.bin("benchmarks", "strategy", "bench_cost_model")])

    def calibration(self):
        self.bench("calibration.json",
                   [self.bin("benchmarks", "strategy", "calibration_report")])

    def deploy_sim(self):
        b = self.bin("benchmarks", "agent", "bench_deploy")
        self.bench("deploy-straggler-64.json", [b, "straggler"])
        self.bench("deploy-straggler-64-reactive.json", [b, "straggler", "--policy", "reactive"])
        self.bench("deploy-straggler-256.json", [b, "straggler", "--ranks", "256", "--steps",
                                                 "300"])
        for i in (1, 2, 3):
            self.bench("deploy-latency-%d.json" % i, [b, "latency"])

    def deploy_scale(self):
        b = self.bin("benchmarks", "agent", "bench_deploy")
        for ranks, runs in ((16384, 3), (65536, 1)):
            for i in range(1, runs + 1):
                # Exit code 3: this machine cannot hold that many connections; the report says
                # why.
                r = run([b, "latency", "--ranks", str(ranks), "--steps", "200", "--step-ms", "200",
                         "--json", self.path("deploy-scale-%d-%d.json" % (ranks, i))],
                        check=False)
                if r.returncode not in (0, 3):
                    sys.exit("failed (exit %d): bench_deploy latency --ranks %d"
                             % (r.returncode, ranks))

    def transport(self):
        self.bench("transport.json", [self.bin("benchmarks", "transport", "bench_transport")])

    def deploy_live(self):
        b = self.bin("benchmarks", "live", "bench_closed_loop")
        self.bench("deploy-live.json", [b, "--rounds", "3"])
        self.bench("deploy-live-reactive.json", [b, "--rounds", "3", "--policy", "reactive"])

    def pytorch(self):
        # Debian's torch 1.13 (the _torch2 entry runs the same test under torch 2.x).
        report = envelope("python_pytorch_job", ["ctest -R ^python_pytorch_job$"])
        with tempfile.TemporaryDirectory() as tmp:
            lines = os.path.join(tmp, "job.jsonl")
            env = dict(os.environ, PARAPILOT_JOB_RESULTS=lines)
            run(["ctest", "--test-dir", self.build, "-R", "^python_pytorch_job$",
                 "--output-on-failure"], env=env)
            with open(lines) as f:
                cases = [json.loads(l) for l in f if l.strip()]
        finish(report, {"cases": cases}, self.path("pytorch-job.json"))
        self.pytorch_overhead()

    def pytorch_matrix(self):
        report = envelope("python job-shape matrix", ["ctest -L matrix -LE torch2"])
        with tempfile.TemporaryDirectory() as tmp:
            lines = os.path.join(tmp, "matrix.jsonl")
            env = dict(os.environ, PARAPILOT_JOB_RESULTS=lines)
            r = run(["ctest", "--test-dir", self.build, "-L", "matrix", "-LE", "torch2",
                     "--output-on-failure"],
                    env=env, check=False)
            with open(lines) as f:
                cases = [json.loads(l) for l in f if l.strip()]
        finish(report, {"cases": cases, "ctest_exit": r.returncode},
               self.path("pytorch-matrix.json"))

    def pytorch_policies(self):
        self.shipped_policy_current()  # deploy's rl reads the build tree's copy
        self.bench("pytorch-policies.json",
                   [sys.executable, os.path.join(ROOT, "benchmarks", "live", "pytorch_policies.py"),
                    "--build", self.build, "--rounds", "5"])

    def fsdp(self):
        # FSDP2 needs torch 2.x: the job runs under the Python of the _torch2 test entries.
        python = os.environ.get("PARAPILOT_TORCH2_PYTHON", "/opt/parapilot/torch2/bin/python")
        self.bench("fsdp-mixed.json",
                   [python, os.path.join(ROOT, "benchmarks", "live", "fsdp_mixed.py"),
                    "--build", self.build, "--python", python, "--rounds", "3"])

    def pytorch_overhead(self):
        args = ["--model", "tutorial", "--global-batch", "256", "--steps", "300",
                "--warmup", "20"]
        report = envelope("examples/pytorch_overhead.py", args)
        with tempfile.TemporaryDirectory() as tmp:
            secret = os.path.join(tmp, "secret")
            with open(secret, "w") as f:
                f.write(os.urandom(16).hex() + "\n")
            os.chmod(secret, 0o600)
            port = 17000 + os.getpid() % 20000
            deploy = subprocess.Popen([self.bin("parapilot"), "deploy", "--listen",
                                       "127.0.0.1:%d" % port, "--secret-file", secret],
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)
            time.sleep(1)
            env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"),
                       PARAPILOT_AGENT="127.0.0.1:%d" % port, PARAPILOT_SECRET_FILE=secret)
            r = run(["/usr/bin/python3", "-m", "parapilot.launch", "--nproc", "4",
                     "examples/pytorch_overhead.py", *args], env=env, capture_output=True,
                    text=True)
            deploy.send_signal(signal.SIGINT)
            log, _ = deploy.communicate(timeout=60)
        result = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
        stopped = [json.loads(l) for l in log.splitlines() if '"agent_stopped"' in l]
        result["deploy_cpu_s"] = stopped[-1]["cpu_s"] if stopped else None
        finish(report, result, self.path("pytorch-overhead.json"))

    def live(self):
        b = self.bin("benchmarks", "live", "bench_live")
        self.bench("live-elastic.json", [b, "elastic"])
        with tempfile.TemporaryDirectory() as tmp:
            self.bench("live-compression.json", [b, "compression", "--out", tmp])
            png = os.path.join(tmp, "loss-curves.png")
            if os.path.exists(png):  # gnuplot present
                os.replace(png, os.path.join(ROOT, "docs", "live-compression-loss.png"))

    def live_layouts(self):
        """The same 20 Adam steps of a 4-block model on 4 workers under six layouts: the last
        step's loss, the final parameters against pure data parallel's (max |difference| / max
        |parameter|) and the wall time of each launch."""
        import array
        layouts = ["dp=4", "pp=4", "dp=2,pp=2,stages=[1,3]", "dp=2,tp=2", "tp=2,pp=2", "tp=4"]
        common = ["--workers", "4", "--agent", "none", "--layers", "4", "--d-model", "64",
                  "--heads", "4", "--seq-len", "64", "--global-batch", "16", "--microbatch", "2",
                  "--steps", "20"]
        report = envelope("parapilot launch", common)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            params = {}
            for i, layout in enumerate(layouts):
                dump, losses = os.path.join(tmp, "p%d.bin" % i), os.path.join(tmp, "l%d.csv" % i)
                start = time.time()
                run([self.bin("parapilot"), "launch", *common, "--layout", layout,
                     "--dump-params", dump, "--loss-log", losses], stdout=subprocess.DEVNULL)
                wall = time.time() - start
                with open(dump, "rb") as f:
                    params[layout] = array.array("f", f.read())
                with open(losses) as f:
                    last = [line.strip().split(",") for line in f if line.strip()][-1]
                rows.append({"layout": layout, "last_step": int(last[0]), "loss": float(last[1]),
                             "wall_s": wall})
        ref = params[layouts[0]]
        scale = max(abs(x) for x in ref)
        for r in rows:
            p = params[r["layout"]]
            r["parameters_vs_dp4"] = (max(abs(a - b) for a, b in zip(p, ref)) / scale
                                      if r["layout"] != layouts[0] else None)
            r["identical_to_dp4"] = p == ref
        finish(report, {"layouts": rows}, self.path("live-layouts.json"))

    def live_switch(self):
        b = self.bin("benchmarks", "live", "bench_switch")
        for mode in ("pause", "slowed", "staging"):
            self.bench("live-switch-%s.json" % mode, [b, mode])

    def pipeline_switch(self):
        self.bench("pipeline-switch.json",
                   [TORCH2_PYTHON, os.path.join(ROOT, "benchmarks", "live", "pipeline_switch.py"),
                    "--build", self.build])

    def netns(self):
        for rate in ("200", "0"):
            self.bench("netns-compression-%s.json" % rate,
                       [sys.executable,
                        os.path.join(ROOT, "benchmarks", "live", "netns_compression.py"),
                        "--steps", "30", "--rounds", "3", "--rate-mbit", rate])

    def netns_congestion(self):
        script = os.path.join(ROOT, "benchmarks", "live", "netns_congestion.py")
        env = dict(os.environ, PARAPILOT_BINARY=self.bin("parapilot"),
                   PYTHONPATH=os.path.join(ROOT, "python"))
        for i in (1, 2, 3):
            run([sys.executable, script, "--json", self.path("netns-congestion-%d.json" % i)],
                env=env)
        # The link recovers after 6 s (about 160 steps at fp16's step): compression off again.
        run([sys.executable, script, "--steps", "360", "--restore-after-s", "6", "--json",
             self.path("netns-congestion-restore.json")], env=env)

    def pipeline_slow(self):
        self.bench("pipeline-slow.json",
                   [TORCH2_PYTHON, os.path.join(ROOT, "benchmarks", "live", "pipeline_slow.py"),
                    "--build", self.build])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "data"))
    ap.add_argument("--training-run", default=None,
                    help="training: keep the run in this folder (default: a temporary one)")
    ap.add_argument("sections", nargs="*", help="default: " + " ".join(SECTIONS))
    a = ap.parse_args()
    unknown = [s for s in a.sections if s not in SECTIONS]
    if unknown:
        ap.error("unknown section %s (known: %s)" % (", ".join(unknown), " ".join(SECTIONS)))
    runner = Runner(a.build, a.out)
    runner.training_run = a.training_run and os.path.abspath(a.training_run)
    for s in a.sections or SECTIONS:
        start = time.time()
        getattr(runner, s.replace("-", "_"))()
        print("%s: %.0f s" % (s, time.time() - start), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
