from rvqstore.blas import blas_is_fast, fast_blas_path


def test_suite_runs_with_fast_blas_when_the_machine_has_it():
    # tests/conftest.py re-executes pytest with OpenBLAS preloaded; CI installs it
    if fast_blas_path() is not None:
        assert blas_is_fast()
    else:
        assert fast_blas_path() is None
