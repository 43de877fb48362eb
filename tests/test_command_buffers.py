"""benchmarks/command_buffers.py: reading XLA's thunk-sequence dump."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import command_buffers  # noqa: E402

DUMP = """\
000: kCommandBuffer [source        | next=015 (1) ]
    001: kCopy         [source       | sink        ] kCopy
    002: kCustomKernel [source       | sink        ] loop_broadcast_fusion_4 grid: [4, 1, 1]
015: kWhile         [prev=000 (1)  | next=000 (1) ]
condition:
    016: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1]
  body:
    017: kCustomKernel  [source         | next=000 (2)  ] wrapped_convert grid: [8, 1, 1]
    018: kCustomCall    [source         | next=000 (1)  ] kCustomCall
    000: kCommandBuffer [prev=018 (1)   | next=024 (1)  ]
        019: kCustomKernel [source       | next=020 (1)] loop_and_fusion grid: [256, 1, 1]
        020: kCustomKernel [prev=019 (1) | next=022 (2)] input_reduce_fusion_326 grid: [4096, 1, 1]
    024: kCustomCall    [prev=000 (1)   | next=000 (1)  ] kCustomCall
025: kCuDnn [source | sink] kCuDnn
"""


def test_thunk_kinds_inside_and_outside_command_buffers():
  inside, outside = command_buffers.thunk_kinds(DUMP)
  assert inside == {"kCopy": 1, "kCustomKernel": 3}
  assert outside == {"kCommandBuffer": 2, "kWhile": 1, "kCustomKernel": 2,
                     "kCustomCall": 2, "kCuDnn": 1}
