"""Capacity planning in virtual time: profiles of measured rates, a discrete-event model of the pipeline
that drives the real staleness gate, and a search over pool splits and async knobs.

* ``profile.py``: ``slipstream profile RUN_DIR``; the profile format (YAML, validated field by field);
* ``simulate.py``: ``slipstream simulate CONFIG --profile P``; the event model;
* ``plan.py``: ``slipstream plan capacity CONFIG --profile P --gpus N``; the search and its frontier plot;
* ``bench.py``: ``slipstream bench simulate``; the model checked against real runs and published figures.
"""
