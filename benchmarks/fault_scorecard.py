"""The fault scorecard: each attack class of the adversarial passes, its repros tried, handled
and failed, measured by running their regression tests now (not by reading a list).

A repro is a test that replays one attack (a folder that is not ours under --overwrite, a
kill at a random moment, a hostile template, ...) and asserts the handled outcome: a named
error, a refusal, a counted bad record, exact bytes after resume. "Handled" is a passing
test, "failed" a failing one; the class's line says which.
Run: python benchmarks/fault_scorecard.py [--fast]   (--fast: skips the slow repros)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CLASSES: dict[str, list[str]] = {
    "--overwrite deletes only what is ours": ["tests/tools/test_overwrite_guards.py"],
    "any sequence of kills resumes": [
        "tests/preprocess/test_crash_points.py",
        "tests/preprocess/test_pipeline.py::test_killed_run_resumes_to_identical_bytes",
        "tests/preprocess/test_ray_engine.py::test_tasks_killed_at_random_writes_are_redone_and_nothing_is_lost_or_doubled",
        "tests/preprocess/test_ray_engine.py::test_a_driver_killed_at_a_random_point_resumes_on_a_cluster_of_another_size",
        "tests/remote/test_bucket_write.py::test_a_killed_cli_run_resumes_from_the_bucket",
        "tests/training/test_resume_kill.py",
    ],
    "bounded templates": ["tests/preprocess/test_faults_templates.py"],
    "open files at load": [
        "tests/training/test_index.py::test_every_dataset_type_loads_and_reads_under_an_open_file_limit_of_256",
        "tests/training/test_item_fast_path.py::test_the_open_shard_limit_keeps_the_most_recently_read",
    ],
    "nothing served or stored unchecked": [
        "tests/preprocess/test_faults_records.py",
        "tests/training/test_faults_load.py",
        "tests/shards/test_verify_index.py",
    ],
    "resume states checked by field": ["tests/training/test_state_validation.py"],
    "errors name cause and place": [
        "tests/preprocess/test_faults_disk.py",
        "tests/remote/test_faults_bucket.py",
        "tests/tools/test_cli_habits.py::test_every_user_error_is_one_line_without_traceback",
        "tests/tools/test_cli_habits.py::test_an_hf_input_that_cannot_be_reached_is_one_line_and_exit_2",
    ],
    "locks and a loaded machine": [
        "tests/remote/test_bucket_tools.py::test_a_stale_lock_is_taken_over_and_its_run_stops_before_commit",
        "tests/remote/test_bucket_tools.py::test_late_heartbeats_do_not_lose_a_lock_nobody_took",
        "tests/remote/test_bucket_tools.py::test_a_run_whose_lock_was_taken_over_writes_and_deletes_nothing",
        "tests/preprocess/test_pipeline.py::test_a_second_run_of_a_live_output_is_refused_naming_it_and_a_dead_runs_lock_is_taken_over",
    ],
}


def run_class(targets: list[str], fast: bool) -> tuple[int, int, int, list[str]]:
    """(tried, handled, skipped, names of the failed) of one class's repros."""
    present = [t for t in targets if (ROOT / t.split("::")[0]).is_file()]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += [f"--junitxml={report}", *present] + (["-m", "not slow"] if fast else [])
        subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        cases = ET.parse(report).getroot().iter("testcase") if report.exists() else []
        tried = handled = skipped = 0
        failed = []
        for case in cases:
            outcome = {child.tag for child in case}
            if "skipped" in outcome:
                skipped += 1
                continue
            tried += 1
            if outcome & {"failure", "error"}:
                failed.append(case.get("name", "?"))
            else:
                handled += 1
    missing = [t for t in targets if t not in present]
    return tried, handled, skipped, failed + [f"{t} (missing)" for t in missing]


def main(fast: bool = False) -> dict[str, float]:
    print(f"{'attack class':<40}{'tried':>7}{'handled':>9}{'failed':>8}")
    totals = [0, 0, 0]
    for name, targets in CLASSES.items():
        tried, handled, skipped, failed = run_class(targets, fast)
        totals[0] += tried
        totals[1] += handled
        totals[2] += len(failed)
        note = f"   failed: {', '.join(failed)}" if failed else ""
        note += f"   ({skipped} skipped)" if skipped else ""
        print(f"{name:<40}{tried:>7}{handled:>9}{len(failed):>8}{note}")
    print(f"{'all':<40}{totals[0]:>7}{totals[1]:>9}{totals[2]:>8}")
    return {"repros tried": totals[0], "handled": totals[1], "failed": totals[2]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="skip the slow repros")
    args = parser.parse_args()
    result = main(args.fast)
    sys.exit(1 if result["failed"] else 0)
