# Shell prologue for the GPU device machine: `source benchmarks/gpu_env.sh`
# from the repository root.
#
# The device image has jax (CUDA), triton and flax but not jax-triton or
# ml-collections. Copy their Python 3.12 wheels into the ignored folder .whl/
# here first (once; /.whl/ is in .gitignore and .git/info/exclude):
#   mkdir -p .whl && cp ../shared/wheels/gpu-py312/{jax_triton,ml_collections}-*.whl .whl/
# and name `.whl` in the run's `carry`.
if ls .whl/*.whl >/dev/null 2>&1; then
  # Once per machine and set of wheels; scripts sourcing this side by side
  # wait on the lock instead of racing in /tmp/site.
  (command -v flock >/dev/null && flock 9
   stamp=$(ls .whl/*.whl | md5sum | cut -d' ' -f1)
   [[ -f /tmp/site/.stamp && $(cat /tmp/site/.stamp) == "$stamp" ]] || {
     python3 -m pip install -q --no-index --no-deps --no-compile \
       --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
     echo "$stamp" > /tmp/site/.stamp; }) 9>/tmp/site.lock || return 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "gpu_env.sh: no wheels in .whl/ (jax_triton will be missing)" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# tests/conftest.py defaults JAX to the CPU; the GPU tests need CUDA.
export JAX_PLATFORMS=cuda
export PYTHONUNBUFFERED=1
# Leave room for torch's copy-bandwidth probe in benchmarks/routing.py.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.7}
python3 -c "import jax, jax_triton, triton; print('gpu_env:', jax.__version__, jax.devices()[0].device_kind, 'jax_triton', jax_triton.__version__, 'triton', triton.__version__)"
