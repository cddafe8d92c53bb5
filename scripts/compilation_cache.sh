# JAX's persistent compilation cache for one test run, shared by
# scripts/run_tests.sh (CI, CPU) and scripts/run_gpu_checks.sh (a CUDA
# machine), which source this file, call start_compilation_cache, and
# remove "$JAX_COMPILATION_CACHE_DIR" when they end.
#
# A pure-JAX program (a test's reference) that another test, worker or
# pytest run already compiled is read back instead of compiled again
# (about a third of the callback run's time on the CPU). A program holding
# a t2j_ad call is never written there: its lowering registers a host
# callback (t2j_ad/backends/registry.py), and JAX caches no program with
# one; each run compiles those itself. The directory is the run's own, so
# nothing outlives it and no other run's entries are read.
start_compilation_cache() {
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d)"
  export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
}
