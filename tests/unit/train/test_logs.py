"""train/output/logs.py: what rank 0 logs before its run folder exists reaches out.log too, once and in order."""
import logging
import logging.handlers

from naflex_accum.train.output.logs import LOGGER_NAME, RunLogger, setup_logging


def _messages(path):
    return [line.split(" | ", 2)[-1] for line in path.read_text().splitlines()]


def test_lines_from_before_the_run_folder_reach_out_log_once_in_order(tmp_path, capsys):
    log = logging.getLogger(LOGGER_NAME)
    setup_logging(None, True)
    log.info("the model")
    log.warning("a warning")
    setup_logging(tmp_path / "out.log", True)
    log.info("the first step")
    assert _messages(tmp_path / "out.log") == ["the model", "a warning", "the first step"]
    out = capsys.readouterr().out
    assert out.count("the model") == 1 and out.count("the first step") == 1  # the console's, once each


def test_a_start_that_made_no_folder_leaves_nothing_for_the_next(tmp_path):
    log = logging.getLogger(LOGGER_NAME)
    setup_logging(None, True)
    log.info("a refused start")
    setup_logging(None, True)  # the next run in this process
    log.info("the next run")
    setup_logging(tmp_path / "out.log", True)
    assert _messages(tmp_path / "out.log") == ["the next run"]


def test_other_ranks_keep_nothing(tmp_path):
    log = logging.getLogger(LOGGER_NAME)
    setup_logging(None, False)
    log.warning("rank 1's warning")
    assert not any(isinstance(h, logging.handlers.MemoryHandler) for h in log.handlers)
    setup_logging(tmp_path / "out.log", False)
    assert not (tmp_path / "out.log").exists()


def test_a_line_cut_off_by_a_full_disk_is_ended_before_a_resume_appends(tmp_path):
    """out.log and results.jsonl filled to the last byte end mid-line: the next start's lines stand alone."""
    log = logging.getLogger(LOGGER_NAME)
    (tmp_path / "out.log").write_text("2026-12-07,10:00:00 | INFO | Train Epoch: 0 [ 16/6")
    (tmp_path / "results.jsonl").write_text('{"epoch": 1}\n{"epoch": 2, "image_to')
    setup_logging(tmp_path / "out.log", True)
    log.info("resumed")
    assert _messages(tmp_path / "out.log")[1:] == ["resumed"]
    RunLogger(log, True, results_file=tmp_path / "results.jsonl").eval(3, {"epoch": 3}, 12)
    assert (tmp_path / "results.jsonl").read_text().splitlines()[2:] == ['{"epoch": 3}']
