"""The fault matrix: what a user sees, and what is left on disk, when things go wrong.

    .venv/bin/python -m benchmarks.faults                    # every case (23 min on 2 shared cores)
    .venv/bin/python -m benchmarks.faults --cases 4,nan-wav  # a subset, by number or name
    .venv/bin/python -m benchmarks.faults --keep /tmp/faults # keep the work folder
    .venv/bin/python -m benchmarks.faults --smoke            # two quick cases (the smoke test's)

It generates a tiny demo set (12 classes x 3 items x 4 ids) in a temporary folder and runs each
case as a user would: subprocesses of `python -m audioclf.train` (torchrun with 2 ranks where the
case is about ranks), `./run.sh`, `audioclf.export` and `audioclf.embed`, all on CPU with one
thread each and the tiny configs of tests/helpers.py. Faults that need a hook inside the run
(a disk that fills up in epoch 2, kill -9 in the middle of torch.save, a stop at step 3) run the
same `audioclf.train` entry point through the fault-injecting worker (injection.py).

Cases 15-19 are the safe defaults: a checkpoint crafted with a pickle payload (unpickling it
would create a marker file) given to evaluate, embed, export, model.init_from= and
checkpoint.resume= (refused, the marker never appears), and a harmless foreign pickle loaded
with the opt-in; two runs into one folder (two trains a second apart, a resume into a live run,
./run.sh --bg twice); Ctrl-C (SIGINT to the job's process group, as a terminal sends it) once
and twice, under ./run.sh --nproc 2 and plain python; a sheet with an upper-case header and
one with a title row above the header, against the plain sheet; the GPU recipes on a CPU
(precision auto, and an explicit bf16).

Cases 20-23 are the outputs users keep (issue 28): a second writer into an embed --index
PREFIX, a search index, a prepare shard and an evaluate --out (refused, naming the holder,
before any work); kill -9 halfway through a write of embed --index's assembly, search build, prepare and
evaluate --out (through the worker's kill-in-write: a file handle that writes half
its first write and SIGKILLs its process), then a later read (never a half or mixed set taken as
whole) and a rerun (equal to a clean run, the killed run's temporary files gone); a full disk
and a read-only folder under embed --index, search build and evaluate; every artefact cut in
half and given to its reader (search index data, PREFIX.npy / .parquet, a part file, TorchScript
/ ONNX exports and a sidecar, prepare.json, a feature file, the run's tracker.json) and a
gallery cache replaced by garbage.

Cases 24-29 are what users and machines do to a run (issue 34): a Ctrl-C half a second and one
second into `python -m audioclf.train --nproc 2` (exit 130, one line, no last.pt claimed); kill -9
of that launcher and of `./run.sh --nproc 2` (the ranks gone within seconds, then resume=auto
on 2 ranks accepted); MLFLOW_TRACKING_URI at a closed port (one warning, the run goes on, in
seconds), the tracker's store deleted before a resume and an evaluate, tracker.json cut in half
before a resume; a full disk under a new run, export and prepare (the writers case 22 leaves
out); a cohort of three copies of one clip (the raw EER / minDCF kept, the reason in
report.json); a run folder, PREFIX.npy, the sheet, a wav and a folder of two checkpoints handed
to evaluate / embed / export as the model.

The last cases (agents.py, issue 42) are torch's agents under plain torchrun: two torchrun
"nodes" on this machine over c10d, then kill -9 of node 1's agent (node 1 holding rank 0, then
rank 1), of node 0's agent (the rendezvous store's host) and of node 1's rank (the killed
agent's rank gone within 10 s, the other node one error line and its torchrun done within
60 s); and `torchrun --max-restarts 1` with checkpoint.resume=auto losing rank 1 after its first
checkpoint (resumed by itself, to the last epoch).

One line per case:

    case | exit code | the message line the user saw | checkpoint intact | data lost

  message line       the first error line on the console (shortened); for a case that should
                     succeed, the line of train.log / stdout that shows it did what it should
  checkpoint intact  yes: the last.pt the case is about (the one before the fault, or the one
                     the run went on to write) loads with audioclf.checkpoint.load and holds
                     only finite tensors; n.a.: the case has none
  data lost          yes: a metrics.csv row of a finished epoch is missing, a half-written file
                     is left (a *.tmp, a 0-byte .pt), or last.pt is older than the last epoch
                     whose checkpoint was written without an error

then a summary, and the reason for every row that is not as expected (each case also checks
its own promises: exit code, one error line, what the message names, what train.log says;
train.log must hold log records only, no traceback text). Every command's console is kept in
<work>/console/NNN.txt (see --keep); a case that acts while a command runs also keeps its
console in <work>/<case>/jobs/.
Exit status: 0 every row as expected, 1 otherwise.

The full-disk and read-only cases mount small tmpfs folders (needs root; otherwise they fall
back to monkeypatched ENOSPC / EROFS errors inside the run or tool, and say so).

The package, each file readable whole: harness.py (rows, commands run as a user runs them,
their checks, the building blocks of the cases), training.py (cases 1-14: faults in a training
run), safe_defaults.py (15-19), outputs.py (20-23), misuse.py (24-29), agents.py (the last), injection.py (the worker that injects a
fault inside a run or a tool) and __main__.py (the case table and the summary).
"""
