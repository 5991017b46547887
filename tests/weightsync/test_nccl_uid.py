"""The ``nccl_uid`` transport's bounded wait and communicator abort, in the parts a CPU can check."""

from __future__ import annotations

from slipstream.weightsync import nccl_uid
from slipstream.weightsync.nccl_uid import abort_comm, wait_done


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_broadcast_that_never_completes_is_given_up_at_its_timeout():
    clock = FakeClock()
    assert not wait_done(lambda: False, 5.0, clock=clock, sleep=clock.sleep)
    assert 5.0 <= clock.now < 5.02 and max(clock.sleeps) == 0.01  # backs off, never past 10 ms a poll


def test_a_broadcast_that_completes_is_seen_at_once():
    clock = FakeClock()
    answers = iter([False, False, True])
    assert wait_done(lambda: next(answers), 5.0, clock=clock, sleep=clock.sleep)
    assert len(clock.sleeps) == 2


def test_an_aborted_communicator_is_kept_from_torchs_destructor_even_when_nccl_is_missing(monkeypatch):
    monkeypatch.setattr(nccl_uid, "_ABORTED", [])
    comm = object()  # no NCCL library on a CPU machine: the abort reports False, the object stays alive
    assert abort_comm(comm) is False
    assert nccl_uid._ABORTED == [comm]
