"""bench_cublaslt_sweep's report: cuBLASLt's enum values named from cublasLt.h, and its argument checks."""
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import bench_cublaslt_sweep as sweep  # noqa: E402

HEADER = """
typedef enum {
  CUBLASLT_MATMUL_TILE_UNDEFINED = 0,
  CUBLASLT_MATMUL_TILE_128x128 = 20,
  CUBLASLT_MATMUL_TILE_256x128 = 24,
} cublasLtMatmulTile_t;
typedef enum { CUBLASLT_MATMUL_STAGES_64xAUTO = 35, } cublasLtMatmulStages_t;
typedef enum { CUBLASLT_CLUSTER_SHAPE_AUTO = 0, CUBLASLT_CLUSTER_SHAPE_1x2x1 = 5, } cublasLtClusterShape_t;
"""


def test_enum_names_from_the_header(tmp_path):
    header = tmp_path / "cublasLt.h"
    header.write_text(HEADER)
    names = sweep.enum_names(header)
    assert names["tile"] == {0: "UNDEFINED", 20: "128x128", 24: "256x128"}
    assert names["stages"] == {35: "64xAUTO"} and names["cluster"] == {0: "AUTO", 5: "1x2x1"}
    assert sweep.enum_names(None) == {}


def test_unknown_mode_is_refused_by_name():
    done = subprocess.run([sys.executable, str(BENCH / "bench_cublaslt_sweep.py"), "--modes", "residual,fast"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown mode(s) fast: choose from residual, inplace, bare" in done.stderr
