#!/usr/bin/env bash
# Entry point of a job submitted with the source uploaded (scripts/submit.sh): `slipstream train` on the
# resolved config the job carries (SLIPSTREAM_JOB_CONFIG), run from a private copy of the uploaded directory.
#
# Why a copy: the job's driver starts inside Ray's extracted working directory, and Ray's runtime-env agent
# may extract that same package again (delete, then unzip: `overwrite=True` in Ray's working_dir plugin)
# when the driver's first actors start, so imports the driver makes after `ray.init` failed at random
# (ModuleNotFoundError for a module that is there a moment later). The actors use Ray's directory, complete
# by the time they start; the driver uses its own copy.
set -euo pipefail

copy="$(mktemp -d "${TMPDIR:-/tmp}/slipstream-job.XXXXXX")"
trap 'rm -rf "$copy"' EXIT
cp -a . "$copy/"
cd "$copy"
printf '%s' "$SLIPSTREAM_JOB_CONFIG" >job-config.yaml
export PYTHONPATH="$copy${PYTHONPATH:+:$PYTHONPATH}"
slipstream train job-config.yaml
