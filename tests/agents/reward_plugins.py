"""Reward functions that misbehave on purpose, loaded by worker processes as `reward_plugins:<name>`."""

import os
import time


def sleeps(response, ground_truth, extra_info):
    time.sleep(float(extra_info.get("sleep_s", 60)))
    return 1.0


def raises(response, ground_truth, extra_info):
    raise RuntimeError("reward function exploded")


def dies(response, ground_truth, extra_info):
    os._exit(3)


def not_a_number(response, ground_truth, extra_info):
    return {"correct": 1.0}


def components(response, ground_truth, extra_info):
    return {"score": 0.5, "format": 1.0}
