"""The shape every training recipe shares (torchtune's recipe classes): ``setup``, a resumable ``train`` loop,
``save_checkpoint``, ``evaluate``, ``save_heads`` and ``cleanup``, run in that order by ``run``.

A subclass builds what it trains and says how a micro-batch is made, counted and scored; ``Recipe`` owns the
optimizer steps, the exact global means under DDP, logging, checkpoints and resuming.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.runtime import kernels
from selfspec.runtime.adapters import export_backbone_adapter
from selfspec.runtime.models import load_model
from selfspec.training import checkpoints, session
from selfspec.training import config as C
from selfspec.training.data import collate

#: Signals that end training the way the time budget does, after the current optimizer step: checkpoint first, then
#: evaluation and heads saved, then exit status 128 + the signal (143, 130: a scheduler that requeues failed jobs
#: runs ``--resume`` again). SIGTERM is what schedulers and process managers (SLURM, Kubernetes, systemd, torchrun's
#: agent) send before they kill; a repeated SIGTERM is ignored (launchers and schedulers may each forward one, and
#: their kill follows anyway). SIGINT is Ctrl-C; a second Ctrl-C stops at once (KeyboardInterrupt).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: ``Recipe.stop_reason`` when ``optim.max_minutes`` ended training (a signal's stop is the signal's name)
TIME_BUDGET = "time budget"


class Recipe:
    """Base class of the ``train/*.py`` recipes.

    ``cfg`` is the recipe's config dataclass (``config_class``); it has at least ``model``, ``output_dir``,
    ``heads_dir``, ``seed``, ``resume`` and the ``data``, ``optim`` and ``logging`` sections (plus ``lora`` for
    ``add_lora``). A subclass implements:

    - ``setup``: ``setup_data``, then build what trains, ``setup_optimizer(module)`` and ``setup_run``;
    - ``counts(batch)``: how many items each loss term of a micro-batch averages over (a scalar or ``[terms]``);
    - ``loss(batch, denominators)``: ``(total, per-term [terms] detached)``, sums divided by ``denominators``;
    - ``step_record(terms)``: the per-step metric fields, from the process mean of the summed per-term losses;
    - ``evaluate`` and ``save_heads(metrics)``; optionally ``make_batch`` and ``tracked_eval``.
    """

    config_class: type  # the recipe's config dataclass
    script: str  # the launched file, recorded in the command saved with the heads
    progress_desc = "train"  # progress bar label
    loss_digits = 3  # decimals of the loss in the progress bar
    final_checkpoint = False  # also checkpoint the last step (so a later run with more steps can --resume from it)

    def __init__(self, cfg, resume: bool = False, argv: list[str] | None = None, allow_changed: tuple[str, ...] = ()):
        self.cfg, self.resume, self.allow_changed = cfg, resume, tuple(allow_changed)
        self.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the heads
        self.output_dir = Path(cfg.output_dir)
        self.heads_dir = Path(cfg.heads_dir or self.output_dir / "heads")

    @classmethod
    def from_command_line(cls, argv: list[str] | None, description: str) -> Recipe:
        """The recipe that ``--config PATH [--resume] [key=value ...]`` describes (``parse_recipe_args``).

        Raises:
            FileNotFoundError / ValueError: a missing config file, an unknown key or a bad value.
        """
        args = C.parse_recipe_args(argv, description)
        cfg = C.load_config(cls.config_class, args.config, args.overrides)
        allowed = tuple(k.strip() for k in args.allow_changed.split(",") if k.strip())
        return cls(cfg, resume=args.resume or cfg.resume, argv=argv, allow_changed=allowed)

    #: why ``train`` stopped before its last step: "time budget", a signal's name ("SIGTERM"), or None
    stop_reason: str | None = None

    @property
    def stopped_early(self) -> bool:
        """Whether ``train`` stopped before its last step (``stop_reason`` says why)."""
        return self.stop_reason is not None

    def run(self) -> dict:
        """Set up, train, evaluate (appended to ``metrics.jsonl``), save the heads and clean up; the metrics."""
        self.setup()
        self.train()
        metrics = self.evaluate()
        self._append_metrics({"step": self.step, **metrics})
        if tracked := self.tracked_eval(metrics):
            self.accelerator.log(tracked, step=self.step)
        self.save_heads(metrics)
        self.cleanup()
        if self.stop_reason in signal.Signals.__members__:  # saved: now end as a signalled command does
            raise SystemExit(128 + signal.Signals[self.stop_reason].value)
        return metrics

    # ------------------------------------------------------------ setup
    def setup(self):
        raise NotImplementedError

    def setup_data(self):
        """The accelerator, the frozen base model and its tokenizer, the train/eval examples and the pad id."""
        cfg = self.cfg
        self.accelerator = session.make_accelerator(self.output_dir, cfg.logging.report_to,
                                                    cfg.optim.gradient_accumulation_steps, cfg.seed,
                                                    cfg.optim.mixed_precision)
        self.base, self.tokenizer = load_model(cfg.model)
        self.base.requires_grad_(False).eval().to(self.accelerator.device)
        self.base_backend = self._set_base_backend()
        self.train_examples, self.eval_examples = session.prepare_examples(
            cfg.data, self.base, self.tokenizer, self.output_dir / "data", self.accelerator, cfg.seed)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _set_base_backend(self) -> str:
        """Put the frozen base's linear layers on ``optim.base_linear_backend`` (``auto``: the faster here,
        measured by the main process so that every process computes features alike) and say so; returns it.

        Raises:
            ValueError: ``onednn`` asked for a base that is not on the CPU, or a PyTorch without oneDNN.
        """
        acc, asked = self.accelerator, self.cfg.optim.base_linear_backend
        on_cpu = next(self.base.parameters()).device.type == "cpu"
        if asked == "onednn" and not on_cpu:
            raise ValueError("optim.base_linear_backend=onednn runs the base's linears on the CPU, but the base is on "
                             f"{acc.device}; use auto or stock there")
        choice = asked
        if asked == "auto":
            choice = [kernels.batch_backend(self.base) if acc.is_main_process else None]
            if acc.num_processes > 1:
                from accelerate.utils import broadcast_object_list

                broadcast_object_list(choice)
            choice = choice[0]
        if choice != "stock":
            kernels.set_linear_backend(self.base, choice)
        if on_cpu:
            acc.print(f"base model forwards (features, teacher): linear layers on {choice}"
                      + (" (measured fastest here)" if asked == "auto" else ""))
        return choice

    def add_lora(self):
        """Inject ``cfg.lora`` adapters into the base model in place (``self.peft`` wraps it): every module that
        holds its decoder now runs them, and they are its only trainable parameters. The base goes back to stock
        kernels first: its forwards now carry gradients, which only stock kernels take."""
        from peft import LoraConfig, get_peft_model

        if self.base_backend != "stock":
            kernels.set_linear_backend(self.base, "stock")
            self.base_backend = "stock"
        lora = self.cfg.lora
        self.peft = get_peft_model(self.base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                         target_modules=list(lora.target_modules)))

    def setup_optimizer(self, trained: torch.nn.Module):
        """Steps per epoch and in total, AdamW over ``trained``'s trainable parameters with the ``optim`` schedule,
        and all three through ``accelerator.prepare``: ``self.model`` is ``trained``, wrapped for DDP if need be."""
        cfg, acc = self.cfg, self.accelerator
        step_examples = cfg.optim.batch_size * acc.num_processes * cfg.optim.gradient_accumulation_steps
        self.steps_per_epoch = max(1, len(self.train_examples) // step_examples)
        # what optim.group_by_length groups by, read once rather than at every step
        self.example_lengths = ([len(e["input_ids"]) for e in self.train_examples] if cfg.optim.group_by_length
                                else None)
        self.total_steps = min(cfg.optim.max_steps or 10**12, self.steps_per_epoch * cfg.optim.epochs)
        params = [p for p in trained.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, C.lr_lambda(cfg.optim, self.total_steps))
        if acc.state.deepspeed_plugin is not None:  # batches are cut by hand, so DeepSpeed cannot infer their size
            acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.optim.batch_size
        self.model, self.optimizer, self.scheduler = acc.prepare(trained, optimizer, scheduler)

    def setup_run(self):
        """Resume from the latest complete checkpoint when asked to, write ``output_dir/config.json`` and start
        the trackers."""
        cfg, acc = self.cfg, self.accelerator
        self.step = 0
        if self.resume:
            ckpt = checkpoints.latest_checkpoint(self.output_dir)
            if ckpt is None:
                acc.print(f"--resume: no complete checkpoint under {self.output_dir / 'checkpoints'}; nothing to "
                          "resume, starting from step 0")
            else:
                saved = checkpoints.saved_trainer_state(ckpt).get("config")
                if saved is not None:  # before any state is loaded: a changed shape would fail there, unexplained
                    C.check_resume_config(saved, C.config_to_dict(cfg), self.allow_changed)
                self.step = checkpoints.load_checkpoint(acc, ckpt)["step"]
                acc.print(f"resumed from {ckpt} (step {self.step})")
                self.after_resume()
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(C.config_to_dict(cfg), indent=2))
        acc.init_trackers(cfg.logging.project, config=C.flat_config(cfg))

    def after_resume(self):
        """Called once a checkpoint's state is loaded: rebuild what ``setup`` derived from state the checkpoint
        replaced (e.g. a draft vocabulary counted on data that ``--allow-changed data.*`` let change)."""

    # ------------------------------------------------------------ per-recipe parts of a step
    def make_batch(self, indices: list[int]) -> dict:
        """The micro-batch of training examples ``indices``."""
        return collate([self.train_examples[i] for i in indices], self.pad_id)

    def counts(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, batch: dict, denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def step_record(self, terms: torch.Tensor) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------ train
    def _step_batches(self, step: int) -> list[list[int]]:
        return C.step_batches(len(self.train_examples), step, self.steps_per_epoch, self.cfg.optim, self.accelerator,
                              self.cfg.seed, self.example_lengths)

    def train(self):
        """Optimizer steps from ``self.step`` (0, or where the checkpoint left off) to ``total_steps``; each step's
        record goes to ``self.history``, and every ``log_every`` steps to the trackers and ``metrics.jsonl``."""
        cfg, acc = self.cfg, self.accelerator
        bar = tqdm(total=self.total_steps, initial=self.step, desc=self.progress_desc,
                   disable=not acc.is_local_main_process)
        self.model.train()
        self.history = []
        started = time.time()
        self.stop_reason = None
        budget = None if cfg.optim.max_minutes is None else cfg.optim.max_minutes * 60.0
        with self._stop_requests() as signalled:
            self._train_steps(bar, started, budget, signalled)
        bar.close()
        if self.final_checkpoint and self.history and not self.stopped_early:
            self.save_checkpoint()
        self.train_seconds = time.time() - started

    def _train_steps(self, bar, started: float, budget: float | None, signalled: list[str]):
        """The optimizer steps of ``train``, until the last, the time ``budget`` (seconds) or a stop signal."""
        cfg, acc = self.cfg, self.accelerator
        tokens_seen = 0
        while self.step < self.total_steps:
            batches = [self.make_batch(ix) for ix in self._step_batches(self.step)]
            denominators = session.global_mean_denominator(acc, torch.as_tensor(sum(self.counts(b) for b in batches)))
            tokens_seen += sum(int(b["attention_mask"].sum()) for b in batches)
            loss_sum, step_terms = 0.0, []
            for m, batch in enumerate(batches):
                # DDP all-reduces the gradients once per optimizer step, in the backward of its last micro-batch.
                with acc.no_sync(self.model) if m < len(batches) - 1 else contextlib.nullcontext():
                    with acc.autocast():  # optim.mixed_precision: the forward and the loss (a no-op when "no")
                        loss, terms = self.loss(batch, denominators)
                    acc.backward(loss)
                loss_sum += loss.detach().item()
                step_terms.append(terms.double())
            if cfg.optim.max_grad_norm:
                acc.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            term_sums = sum(step_terms).float()
            mean_loss = acc.reduce(torch.tensor(loss_sum, device=acc.device), reduction="mean").item()
            record = {"step": self.step, "loss": mean_loss,
                      "lr": self.scheduler.get_last_lr()[0],
                      **self.step_record(acc.reduce(term_sums, reduction="mean") if term_sums.numel() else term_sums)}
            self.history.append(record)
            if self.step % cfg.logging.log_every == 0 or self.step == self.total_steps:
                acc.log(record, step=self.step)
                self._append_metrics(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.{self.loss_digits}f}",
                            tok_s=f"{tokens_seen * acc.num_processes / max(1e-9, time.time() - started):.0f}")
            if cfg.logging.eval_every and self.step % cfg.logging.eval_every == 0 and self.step < self.total_steps:
                self.evaluate_during_training()
            if cfg.logging.save_every and self.step % cfg.logging.save_every == 0 and self.step < self.total_steps:
                self.save_checkpoint()
            if self.step < self.total_steps and (reason := self._stop_now(started, budget, signalled)):
                self.stop_reason = reason
                cause = (f"time budget of {cfg.optim.max_minutes:g} min reached" if reason == TIME_BUDGET
                         else f"{reason} received")
                acc.print(f"{cause} at step {self.step} of {self.total_steps}: checkpointing, evaluating and "
                          "saving the heads; rerun with --resume (same config) to continue")
                if not (cfg.logging.save_every and self.step % cfg.logging.save_every == 0):
                    self.save_checkpoint()
                break

    def evaluate_during_training(self):
        """The held-out evaluation at this step (``logging.eval_every``), appended to ``metrics.jsonl`` as
        ``{"step", "eval": true, ...}`` (the learning curve) and sent to the trackers; training then resumes."""
        metrics = self.evaluate()
        self._append_metrics({"step": self.step, "eval": True, **metrics})
        if tracked := self.tracked_eval(metrics):
            self.accelerator.log(tracked, step=self.step)
        self.model.train()

    def _stop_now(self, started: float, budget: float | None, signalled: list[str]) -> str | None:
        """Why training stops after this step: ``"time budget"``, the name of a stop signal (``"SIGTERM"``), or
        None. Decided together: any process out of time or signalled stops every process at the same step."""
        flags = torch.tensor([float(budget is not None and time.time() - started >= budget),
                              *(float(s.name in signalled) for s in STOP_SIGNALS)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags.to(self.accelerator.device), reduction="sum").cpu()
        if flags[0] > 0:
            return TIME_BUDGET
        return next((s.name for s, sent in zip(STOP_SIGNALS, flags[1:]) if sent > 0), None)

    @contextlib.contextmanager
    def _stop_requests(self):
        """While the optimizer steps run, a ``STOP_SIGNALS`` signal is noted (its name appended to the yielded list)
        instead of killing the process, so the loop can stop cleanly after the step; a second Ctrl-C raises
        KeyboardInterrupt, a repeated SIGTERM is ignored. Outside the loop (loading, caching the hidden states, which
        resume by chunk anyway, the final evaluation) signals act as usual."""
        signalled: list[str] = []
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            yield signalled
            return
        # A signal the process ignores (SIGINT of a background job) stays ignored; None: a handler set outside
        # Python, left alone.
        previous = {s: h for s in STOP_SIGNALS if (h := signal.getsignal(s)) not in (signal.SIG_IGN, None)}

        def restore():
            for s, handler in previous.items():
                signal.signal(s, handler)

        def note(signum, frame):
            if signalled and signum == signal.SIGINT:  # a second Ctrl-C: what it did before (KeyboardInterrupt)
                restore()
                if callable(previous[signum]):
                    previous[signum](signum, frame)
                else:
                    os.kill(os.getpid(), signum)
                return
            if signalled:  # a repeated SIGTERM (forwarded by a launcher too): the stop is under way
                return
            signalled.append(signal.Signals(signum).name)
            # os.write, not print: the signal may have interrupted a write to stderr (tqdm's bar), and Python's
            # buffered stderr refuses a reentrant call
            again = "; Ctrl-C again stops at once" if signum == signal.SIGINT else ""
            os.write(2, f"\n{signalled[0]} received: stopping after this optimizer step (checkpoint, evaluation, "
                        f"heads saved; --resume continues){again}\n".encode())

        for s in previous:
            signal.signal(s, note)
        try:
            yield signalled
        finally:
            restore()

    def save_checkpoint(self):
        checkpoints.save_checkpoint(self.accelerator, self.output_dir, self.step,
                                    {"config": C.config_to_dict(self.cfg)}, keep_last=self.cfg.logging.keep_last)

    # ------------------------------------------------------------ evaluate and save
    def evaluate(self) -> dict:
        raise NotImplementedError

    def tracked_eval(self, metrics: dict) -> dict:
        """The evaluation metrics to send to the trackers (none by default; ``metrics.jsonl`` has them all)."""
        return {}

    def save_heads(self, metrics: dict):
        raise NotImplementedError

    def command(self) -> str:
        """The command line that ran this recipe, as recorded with the heads."""
        launcher = "accelerate launch" if "LOCAL_RANK" in os.environ else "python"
        return f"{launcher} {self.script} {' '.join(shlex.quote(a) for a in self.argv)}"

    @contextlib.contextmanager
    def exported_backbone_adapter(self):
        """``(staging, spec, merged model)``: the LoRA adapter saved into a temporary directory under
        ``output_dir`` and merged into the base (``selfspec.runtime.adapters.export_backbone_adapter``), so that
        ``save_pretrained(..., backbone_adapter=staging)`` writes it with the heads in one atomic step."""
        import tempfile

        with tempfile.TemporaryDirectory(dir=self.output_dir) as staging:
            spec, merged = export_backbone_adapter(self.peft, staging)
            yield staging, spec, merged

    def _append_metrics(self, record: dict):
        if self.accelerator.is_main_process:
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def cleanup(self):
        self.accelerator.end_training()
