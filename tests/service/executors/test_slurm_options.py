"""A job's own Slurm options (the request's ``slurm`` object): refused with 422 on bad values and on a server that
does not run jobs on Slurm, and on a Slurm server written into the job's batch script over the settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.operations import check_request
from service.config import Settings
from service.errors import InvalidRequest
from service.executors.slurm_cli import SlurmResources, array_script, calibrated_script
from service.executors.slurm_options import conversion_fields, job_resources

BODY = {"model": "demo/tiny-llama", "recipe": {"backend": "ao"},
        "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@pytest.mark.parametrize(("slurm", "field"), [
    ({"partition": "gpu\n#SBATCH --exclusive"}, "partition"),  # a second directive in the batch script
    ({"partition": "a b"}, "partition"),
    ({"account": "$(id)"}, "account"),
    ({"nodes": 0}, "nodes"),
    ({"nodes": "2"}, "nodes"),
    ({"gpus_per_node": 65}, "gpus_per_node"),
    ({"time_limit": "1h"}, "time_limit"),
    ({"time_limit": "10; rm -rf ~"}, "time_limit"),
    ({"qos": "high"}, "qos"),
])
def test_bad_slurm_values_get_422_naming_the_field(client, slurm, field):
    response = client.post("/v1/jobs", json={**BODY, "slurm": slurm})
    assert response.status_code == 422, response.text
    assert field in response.json()["error"]["field"], response.json()


def test_a_server_without_the_slurm_executor_refuses_the_object_naming_it(client):
    response = client.post("/v1/jobs", json={**BODY, "slurm": {"partition": "debug"}})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "slurm" and "FP8FORGE_EXECUTOR=slurm" in error["message"]
    assert client.post("/v1/jobs", json=BODY).status_code in (201, 202)  # the same job without it is queued


def test_a_slurm_server_takes_the_job_and_its_script_asks_for_its_allocation(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", executor="slurm", slurm_partition="cpu", slurm_time_limit="30",
                        slurm_account="lab", auth_disabled=True)
    request = {**BODY, "slurm": {"partition": "gpu", "nodes": 2, "gpus_per_node": 4, "time_limit": "1-00:00"}}
    check_request(request, settings)  # accepted; the conversion library never sees the slurm object
    assert "slurm" not in conversion_fields(request) and conversion_fields(request)["model"] == BODY["model"]
    resources = job_resources(SlurmResources.from_settings(settings), request, settings)
    script = calibrated_script("j1", resources, python="python3", settings_file=Path("s.json"), output_dir=tmp_path)
    for line in ("--partition=gpu", "--account=lab", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4",
                 "--time=1-00:00"):
        assert f"#SBATCH {line}\n" in script, script
    assert "--partition=cpu" not in script and "--time=30" not in script
    plain = calibrated_script("j2", job_resources(SlurmResources.from_settings(settings), BODY, settings),
                              python="python3", settings_file=Path("s.json"), output_dir=tmp_path)
    assert "#SBATCH --partition=cpu\n" in plain and "#SBATCH --time=30\n" in plain and "--nodes=1" in plain
    array = array_script("j3", resources, python="python3", settings_file=Path("s.json"), output_dir=tmp_path)
    assert "#SBATCH --partition=gpu\n" in array and "#SBATCH --time=1-00:00\n" in array


def test_settings_fix_the_ranks_per_node_whatever_the_jobs_gpus(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", executor="slurm", slurm_ranks_per_node=2, auth_disabled=True)
    resources = job_resources(SlurmResources.from_settings(settings), {"slurm": {"gpus_per_node": 8}}, settings)
    assert (resources.gpus_per_node, resources.ranks_per_node) == (8, 2)
    with pytest.raises(InvalidRequest):
        check_request({**BODY, "slurm": {}}, Settings(data_dir=tmp_path / "local", auth_disabled=True))
