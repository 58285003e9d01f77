"""Python helpers shared by the tests, the benchmark and the demo.

Import with the repository root on sys.path: `from testkit import harness`.
"""
