"""A native build killed half-way never blocks the next one (``attnlab._native._build_lock``)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

from attnlab import _native


def test_a_stale_cpp_extension_lock_is_removed_under_our_lock(tmp_path):
    (tmp_path / "lock").write_text("")  # what a build killed inside cpp_extension.load leaves behind
    with _native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_lock_of_a_killed_builder_is_released(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from attnlab import _native
        with _native._build_lock(Path({str(tmp_path)!r})):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def take():
            with _native._build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "the lock must exclude a second builder while the first lives"
        os.kill(holder.pid, signal.SIGKILL)
        assert entered.wait(60), "a killed builder's lock must be released"
    finally:
        holder.kill()
        holder.wait()
