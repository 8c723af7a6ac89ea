#!/usr/bin/env bash
# One more torch release besides the default (#26, docs/torch.md): a fresh venv with that torch
# installed first, castwise and its test dependencies resolved against it, then the core tests
# (policy, applied, trace, auditor) and `castwise demo`. CI runs it for the floor (2.10), 2.12 and
# the newest release; by hand: .ci/torch_matrix.sh 2.13.0
# Usage: .ci/torch_matrix.sh TORCH_VERSION [VENV_DIR]
# Exit: 0 passed; 1 tests or demo failed; 3 the release could not be installed (the registry did
# not answer twice): CI reports that and goes on, a test failure fails it.
set -uo pipefail
version="${1:?usage: .ci/torch_matrix.sh TORCH_VERSION [VENV_DIR]}"
cd "$(dirname "$0")/.."
venv="${2:-.venv-torch-$version}"
start=$SECONDS

install() {
  # torch first and pinned in every later install: pip must not trade it for another release
  # (PIP_CONSTRAINT: a machine-wide cap on torch, as some build machines set, must not apply here)
  python3 -m venv "$venv" &&
    PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q "torch==$version" &&
    PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q -e ".[test]" "torch==$version"
}
if ! install && ! install; then
  echo "torch $version: could not be installed (twice); not checked" >&2
  exit 3
fi
installed=$SECONDS
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_policy.py tests/test_policy_fields.py \
  tests/test_policy_rules.py tests/test_applied.py tests/trace tests/auditor
tests=$?
"$venv/bin/castwise" demo
demo=$?
echo "torch $version: install $((installed - start))s, core tests + demo $((SECONDS - installed))s" \
  "(pytest exit $tests, demo exit $demo)"
[ "$tests" -eq 0 ] && [ "$demo" -eq 0 ]
