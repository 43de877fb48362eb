"""The disk cache around jax-triton's Triton -> PTX compile (CPU: a fake
compile function stands in for Triton's)."""
import dataclasses
import os

from mhar_jax.kernels import ptx_cache


@dataclasses.dataclass
class Result:
  binary: str
  name: str
  shared_mem_bytes: int
  ttgir: str | None
  llir: str | None


class Module:
  """Stands in for the TTIR module: its text is the kernel; the compile
  rewrites it in place, as Triton's passes do."""

  def __init__(self, text):
    self.text = text

  def __str__(self):
    return self.text


def make(cache_dir):
  calls = []

  def compile_fn(ttir, backend, options, cc, platform):
    calls.append(str(ttir))
    out = Result(binary=f"ptx of {ttir} {options} sm{cc}",
                 name="k_" + str(ttir),
                 shared_mem_bytes=len(str(ttir)) * 16, ttgir="g", llir="l")
    ttir.text = "lowered"
    return out

  return ptx_cache.cached(compile_fn, Result, lambda: cache_dir,
                          ("3.5", "0.3.1")), calls


def test_second_process_reads_the_first_ones_ptx(tmp_path):
  first, calls = make(str(tmp_path))
  a = first(Module("kernel A"), None, "warps=4", 90, "cuda")
  assert calls == ["kernel A"]
  # A new process: a fresh wrapper, same directory.
  second, calls2 = make(str(tmp_path))
  b = second(Module("kernel A"), None, "warps=4", 90, "cuda")
  assert calls2 == []
  assert (b.binary, b.name, b.shared_mem_bytes) == (a.binary, a.name,
                                                    a.shared_mem_bytes)
  files = os.listdir(tmp_path / ptx_cache.SUBDIR)
  assert len(files) == 1 and files[0].endswith(".json")


def test_every_input_of_the_compile_is_in_the_key(tmp_path):
  wrapped, calls = make(str(tmp_path))
  wrapped(Module("kernel A"), None, "warps=4", 90, "cuda")
  wrapped(Module("kernel B"), None, "warps=4", 90, "cuda")
  wrapped(Module("kernel A"), None, "warps=8", 90, "cuda")
  wrapped(Module("kernel A"), None, "warps=4", 80, "cuda")
  other_versions = ptx_cache.cached(
      wrapped.__wrapped__, Result, lambda: str(tmp_path), ("3.6", "0.3.1"))
  other_versions(Module("kernel A"), None, "warps=4", 90, "cuda")
  assert len(calls) == 5
  wrapped(Module("kernel B"), None, "warps=4", 90, "cuda")
  assert len(calls) == 5
  assert len(os.listdir(tmp_path / ptx_cache.SUBDIR)) == 5


def test_nothing_cached_without_a_directory_or_off_cuda(tmp_path):
  wrapped, calls = make(None)
  wrapped(Module("kernel A"), None, "o", 90, "cuda")
  wrapped(Module("kernel A"), None, "o", 90, "cuda")
  assert len(calls) == 2
  rocm, calls = make(str(tmp_path))
  rocm(Module("kernel A"), None, "o", 90, "rocm")
  rocm(Module("kernel A"), None, "o", 90, "rocm")
  assert len(calls) == 2 and not (tmp_path / ptx_cache.SUBDIR).exists()


def test_a_corrupt_entry_is_compiled_again_and_rewritten(tmp_path):
  wrapped, calls = make(str(tmp_path))
  good = wrapped(Module("kernel A"), None, "o", 90, "cuda")
  (entry,) = (tmp_path / ptx_cache.SUBDIR).iterdir()
  entry.write_text('{"binary": "trunc')
  again = wrapped(Module("kernel A"), None, "o", 90, "cuda")
  assert len(calls) == 2 and again.binary == good.binary
  third, calls3 = make(str(tmp_path))
  assert third(Module("kernel A"), None, "o", 90, "cuda").binary == good.binary
  assert calls3 == []


def test_an_unwritable_directory_still_compiles(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  wrapped, calls = make(str(blocker))
  out = wrapped(Module("kernel A"), None, "o", 90, "cuda")
  assert calls == ["kernel A"] and out.name == "k_kernel A"
