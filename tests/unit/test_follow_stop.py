"""A follow run stops only once Spark has recorded the commit of what it folded."""

from outbox.pipeline.follow import FollowRun, _committed


def test_nothing_folded_needs_no_commit():
    assert _committed(None, FollowRun())


def test_a_folded_batch_waits_for_its_progress():
    run = FollowRun(folded=[3])
    assert not _committed(None, run)
    assert not _committed({"batchId": 2}, run)  # the previous trigger's progress: commit 3 not written yet
    assert _committed({"batchId": 3}, run)
    assert _committed({"batchId": 4}, run)  # a later trigger without data reports the next id


def test_a_skipped_batch_counts_too():
    run = FollowRun(folded=[1], skipped=[2])
    assert not _committed({"batchId": 1}, run)
    assert _committed({"batchId": 2}, run)
