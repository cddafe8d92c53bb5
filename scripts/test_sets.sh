# The test files of the second and third pytest runs, shared by
# scripts/run_tests.sh (CI, CPU) and scripts/run_gpu_checks.sh (a CUDA
# machine), which source this file.

# The core transform tests and the property suite again with every PyTorch
# function traced (T2J_AD_COMPILE=graph), with fewer property examples than
# the eager run (60 per pair): the same math, every example traced; CI's
# 20-minute budget has room for 5 per pair. Tests that choose their compile
# mode themselves are deselected there: they ran the very same calls in the
# first run (NOTE [tests that choose their compile mode] in tests/conftest.py).
GRAPH_MODE_TESTS=(tests/test_ad.py tests/test_batching.py tests/test_module.py tests/test_ad_fallbacks.py tests/test_jet.py tests/property)
GRAPH_MODE_EXAMPLES=5

# The core tests again on the Python callback backend (T2J_AD_BACKEND=callback),
# but for the bad environment variables: each starts fresh interpreters
# (about 6 s of a 2-core machine), and the first run tried each already (one
# of them T2J_AD_BACKEND, whose good value there is this backend).
CALLBACK_TESTS=(tests/test_api.py tests/test_module.py tests/test_bad_input.py tests/test_ad.py tests/test_batching.py
  tests/test_calls_under_jit.py -k "not test_bad_environment_variable_is_a_value_error_naming_it")
