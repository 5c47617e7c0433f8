"""VBench on one video, run in vbench's own interpreter by `sdvg.evaluation.external` as `python vbench_job.py JOB.json`.

The job (JSON) names the video, its prompt, the dimensions, the device and an output folder. VBench's
custom_input mode evaluates the video (weights from $VBENCH_CACHE_DIR, local mode); this script then
writes each dimension's score of the video to the job's `result` file. It imports vbench only, never
sdvg, so that it runs under vbench's pinned stack."""
import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python vbench_job.py JOB.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    import vbench
    from vbench import VBench

    full_info = os.path.join(os.path.dirname(vbench.__file__), "VBench_full_info.json")
    bench = VBench(job["device"], full_info, job["output"])
    bench.evaluate(videos_path=job["video"], name=job["name"], prompt_list=[job["prompt"]],
                   dimension_list=job["dimensions"], local=True, mode="custom_input")
    with open(os.path.join(job["output"], job["name"] + "_eval_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    scores = {}
    for dim in job["dimensions"]:
        per_video = results[dim][1]  # (the mean over videos, [{"video_path", "video_results"}])
        if len(per_video) != 1:
            print(f"VBench gave {len(per_video)} results for {dim} of {job['video']}, expected one", file=sys.stderr)
            return 1
        scores[dim] = float(per_video[0]["video_results"])  # dynamic_degree's is a bool
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(scores, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
