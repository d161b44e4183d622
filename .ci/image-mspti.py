"""Runs inside the image (as its user, on its read-only root): agent.worker on the fake libmspti.so
built for the image's architecture, as a training process uses it.

Environment: LD_LIBRARY_PATH holds the fake (the worker finds libmspti.so there and this process
loads the same instance to emit records); NPU_AGENT_PROFILING_ROOT, NPU_AGENT_PROFILING_SWITCH and
MINDX_TASK_ID point into a writable mount. argv[1]: how many marker records to emit.
Prints one JSON line (implementation, stats); .ci/image-smoke.py reads the records from the mount.
"""

import ctypes
import json
import os
import sys
import time

import agent.worker as worker

MARKER = 1  # msptiActivityKind
count = int(sys.argv[1])

# TaskD's switch file: any field not "off" turns the default domain on.
with open(os.environ["NPU_AGENT_PROFILING_SWITCH"], "w") as f:
    json.dump({"CommunicationOperator": "off", "Step": "on", "SaveCheckpoint": "off", "FP": "off",
               "DataLoader": "off"}, f)

if not (worker.init_taskd_worker(0) and worker.start_taskd_worker()):
    sys.exit("agent.worker did not start (see the log above)")
fake = ctypes.CDLL(worker.find_library(), mode=ctypes.RTLD_GLOBAL)
fake.fake_mspti_emit.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
fake.fake_mspti_state.restype = ctypes.c_uint64

deadline = time.monotonic() + 60  # the switch file is polled every second; emulation is slow
while not fake.fake_mspti_state() & (1 << MARKER):
    if time.monotonic() > deadline:
        sys.exit("the worker did not enable MSPTI's marker activity within 60 s of the switch turning on")
    time.sleep(0.05)
fake.fake_mspti_emit(count, b"image-smoke", b"default", 16, 0)
fake.fake_mspti_wait_idle()
print(json.dumps({"implementation": worker.implementation(), "stats": worker.stats()}, default=str))
# The rest is written by the worker's atexit hook, as in a training process.
