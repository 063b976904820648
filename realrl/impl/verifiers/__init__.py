"""Reward verifiers. `math_verifier`: numeric and math-verify answer checking.

Import the submodule directly (`from realrl.impl.verifiers.math_verifier import
...`); this package stays empty so `python -m realrl.impl.verifiers.math_verifier`
(the verifier child process) does not import its own module twice.
"""
