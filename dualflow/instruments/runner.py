"""Training the arms of `dualflow experiment`: the corpus, one run (train from scratch, score), runs in processes."""

import os
import platform
import signal
import time
from contextlib import ExitStack, contextmanager
from multiprocessing import get_context

import torch
from tqdm.auto import tqdm

from ..errors import DualFlowUserError
from ..scoring import mean_token_nll, mean_token_nlls
from .arms import DESIGN_KEYS, Arm
from .data import check_data_files, read_byte_tokens, split_files, spread_blocks, stdlib_source_files
from .tiny_lm import TinyScale, train_language_model


MAX_TRAIN_TOKENS = 20_000_000


def load_corpus(data_paths, scale: TinyScale) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """
    (train tokens, validation blocks, description): split by file; a single file is split 90/10 by position. The
    validation blocks are spread evenly over all validation files and are the same for every arm and seed.
    """
    files = check_data_files(data_paths) if data_paths else stdlib_source_files()
    train_files, val_files = split_files(files)
    train = read_byte_tokens(train_files, max_tokens=MAX_TRAIN_TOKENS)
    if val_files:
        blocks, files_hit = spread_blocks(val_files, scale.block_size, scale.eval_blocks)
    else:
        cut = int(len(train) * 0.9)
        train, val = train[:cut], train[cut:]
        num_blocks = min(scale.eval_blocks, len(val) // scale.block_size)
        if num_blocks == 0:
            raise DualFlowUserError(
                f"validation data holds {len(val)} tokens, fewer than one block of {scale.block_size}"
            )
        blocks, files_hit = val[: num_blocks * scale.block_size].view(num_blocks, -1).long(), 0
    if len(train) <= scale.block_size:
        raise DualFlowUserError(
            f"training data holds {len(train)} tokens, need more than a block of {scale.block_size}"
        )
    description = {
        "source": "--data files" if data_paths else f"Python {platform.python_version()} standard library sources",
        "files": len(files),
        "train_files": len(train_files),
        "val_files": len(val_files) or "last 10% of the single file",
        "val_files_with_a_block": files_hit,
        "train_tokens_available": len(train),
        "val_blocks": len(blocks),
        "val_tokens": blocks.numel(),
        "val_sampling": "blocks at evenly spaced offsets over the concatenated validation files",
        "tokenization": "byte-level (UTF-8 bytes, vocab 256)",
    }
    return train, blocks, description


_WORKER_DATA: dict = {}

# Signals the parent handles (Ctrl-C; SIGTERM and SIGHUP as interrupts) and its pool workers must not: a terminal's
# Ctrl-C reaches the whole process group and only the parent answers it; Pool.terminate() ends workers with SIGTERM,
# which must kill even a worker stuck in C code, where a Python handler never runs.
_WORKER_DISPOSITIONS = {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
_forking_pool = False  # read in the child at fork time


def _unblock_in_pool_worker():
    if _forking_pool:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_WORKER_DISPOSITIONS))


os.register_at_fork(after_in_child=_unblock_in_pool_worker)


@contextmanager
def fork_pool(processes: int, initializer=None, initargs=()):
    """
    A fork Pool (workers share the loaded modules and data; torch resets its thread pools at fork) whose workers
    ignore SIGINT and die of SIGTERM and SIGHUP. The workers get those dispositions at fork, before running any code:
    the parent blocks the signals and switches to the workers' dispositions while it forks, so one that arrives
    meanwhile waits for the parent's own handler instead of being lost or reaching it as the default action.
    """
    global _forking_pool
    signal.pthread_sigmask(signal.SIG_BLOCK, set(_WORKER_DISPOSITIONS))
    parent_dispositions = {signum: signal.signal(signum, action) for signum, action in _WORKER_DISPOSITIONS.items()}
    _forking_pool = True
    try:
        pool = get_context("fork").Pool(processes, initializer, initargs)
    finally:
        _forking_pool = False
        for signum, action in parent_dispositions.items():
            signal.signal(signum, action)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_WORKER_DISPOSITIONS))  # what came meanwhile is handled here
    with pool:
        yield pool


def _init_worker(train_tokens, val_blocks, threads):
    torch.set_num_threads(threads)
    _WORKER_DATA.update(train=train_tokens, val=val_blocks)


def train_and_score(arm: Arm, scale: TinyScale, seed: int, train_tokens=None, val_blocks=None) -> dict:
    """One run: train `arm` from scratch with `seed`, score its prediction (and its primary flow) on the blocks."""
    train_tokens = _WORKER_DATA["train"] if train_tokens is None else train_tokens
    val_blocks = _WORKER_DATA["val"] if val_blocks is None else val_blocks
    arm_scale, steps = arm.scale(scale), arm.steps(scale)
    start, cpu_start = time.perf_counter(), time.process_time()
    model, curve = train_language_model(
        arm.model_config(scale),
        train_tokens,
        arm_scale,
        seed,
        steps=steps,
        show_progress=False,
        aux_design={key: value for key, value in arm.training.items() if key in DESIGN_KEYS},
    )
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = steps * scale.batch_size * scale.block_size
    # CPU seconds too: on a shared machine the wall clock also counts other processes' turns.
    run = {"seed": seed, "train_s": train_s, "train_cpu_s": cpu_s, "tokens_per_s": tokens / train_s}
    run["tokens_per_cpu_s"] = tokens / cpu_s
    if arm.dual:  # one pass scores both flows: the primary logits come with the prediction
        losses = mean_token_nlls(model, val_blocks, ("logits", "primary_logits"), batch_size=32, use_aux_flow=True)
        run["val_loss"], run["primary_val_loss"] = losses["logits"], losses["primary_logits"]
    else:
        run["val_loss"], run["primary_val_loss"] = mean_token_nll(model, val_blocks, 32, use_aux_flow=False), None
    run["train_curve"] = curve
    return run


def run_arms(arms, scale, seeds, train_tokens, val_blocks, jobs=1, threads=1, done=None, on_run=None):
    """
    Train every arm for every seed it has no run for in `done` ({arm name: runs}), `jobs` runs at a time in their own
    processes (`threads` torch threads each), in seed-major order, so an interrupted run still covers every arm.
    `on_run(results)` sees the results after each finished run. Returns {arm name: runs}, `done` included.
    """
    results = {name: list(runs) for name, runs in (done or {}).items()}
    for arm in arms:
        results.setdefault(arm.name, [])
    tasks = [(arm, seed) for seed in seeds for arm in arms if seed not in {run["seed"] for run in results[arm.name]}]
    with ExitStack() as stack:
        # the workers fork before the bar starts its monitor thread: a fork copies no other thread's locks
        pool = (
            stack.enter_context(fork_pool(jobs, _init_worker, (train_tokens, val_blocks, threads)))
            if jobs > 1
            else None
        )
        bar = stack.enter_context(tqdm(total=len(tasks), desc="runs"))

        def finished(arm, run):
            results[arm.name].append(run)
            if on_run is not None:
                on_run(results)
            bar.set_postfix_str(f"{arm.name} seed {run['seed']}: val {run['val_loss']:.4f}")
            bar.update()

        if pool is None:
            torch.set_num_threads(threads)
            for arm, seed in tasks:
                finished(arm, train_and_score(arm, scale, seed, train_tokens, val_blocks))
        else:
            pending = [(arm, pool.apply_async(train_and_score, (arm, scale, seed))) for arm, seed in tasks]
            for arm, result in pending:
                finished(arm, result.get())
    return results
