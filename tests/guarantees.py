"""What the docs call tested, and the tests that prove it: one registry, checked both ways.

Every item (paragraph, list item, table row) of ``README.md`` and ``docs/**/*.md`` that says a behaviour is
tested -- see :data:`TRIGGER`: "tested", a test file's name, "a test", "the tests", "the test suite",
"Distributed tests start ...", and every item of a "How it is tested" / "What is tested" section or of a list
a claim introduces with ``:`` -- must hold the ``claim`` phrase of a :class:`Guarantee` below for that doc, on
the line that triggered it. Each guarantee names the test node ids that check that claim; a line that matches
the pattern but claims nothing (a test helper, the test cluster, a statement of what is *not* tested) is a
:class:`NotAClaim` with its reason.

``tests/test_guarantees.py`` checks, without running them, that every claim is registered, that every id is
collected and selected by CI (not skipped when ``FSDP_STRATEGIES_FULL`` is unset, not ``soak``, a
``tests/slurm`` id inside ``.ci/run``'s ``SLURM_SELECT``), and that a test file a claim names is among its
ids' files. ``tests/check_guarantees.py JUNIT...`` checks, after CI ran them, that every id passed. See
docs/testing.md, "What the docs call tested, and where".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Guarantee:
    """``claim``: a phrase of ``doc`` (a substring of one item, on the line that says it is tested), proved by
    ``tests``."""

    doc: str
    claim: str
    tests: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class NotAClaim:
    """A line the pattern catches that claims no tested behaviour; ``why`` says what it is instead."""

    doc: str
    phrase: str
    why: str


#: What makes an item a claim. "tested" (not "Not tested"), a test file's name, "a/the/each/one test(s)" (not
#: a test helper, the test cluster or "a test or trial script"), "the test suite", "tests
#: check/show/start/corrupt/run".
TRIGGER = re.compile(
    r"(?<![Nn]ot )(?<!-)\btested\b"  # (not "Not tested", not an anchor like #how-it-is-tested)
    r"|\b(?:tests/(?:\w+/)*)?test_\w+\.py\b"
    r"|\b(?:[Aa]|[Tt]he|[Ee]ach|[Oo]ne) tests?\b(?! (?:helper|cluster|or trial))"
    r"|\btest suite\b"
    r"|\btests (?:check|show|start|corrupt|run)s?\b")
#: headings whose every item is a claim
CLAIM_SECTION = re.compile(r"(?i)^(how it is tested|what is tested)\b")
TEST_FILE = re.compile(r"\b((?:tests/(?:\w+/)*)?test_\w+\.py)\b")


@dataclass
class Item:
    """A paragraph, list item or table row of a Markdown file, its lines joined by one space."""

    doc: str
    line: int  # first line, 1-based
    text: str = ""
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (line, start, end) in text
    claim_lines: set[int] = field(default_factory=set)  # the lines that make it a claim

    def add(self, lineno: int, line: str) -> None:
        if self.text:
            self.text += " "
        start = len(self.text)
        self.text += line.strip()
        self.spans.append((lineno, start, len(self.text)))

    def line_of(self, pos: int) -> int:
        return next(line for line, start, end in self.spans if start <= pos <= end)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page of docs/ (the pages are sources: generated content is inserted at build
    time)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def items(text: str, doc: str) -> list[Item]:
    """The items of a Markdown text that claim something is tested (code blocks and headings aside)."""
    every: list[tuple[Item, bool, bool]] = []  # (item, is a list item, inside a claim section)
    current: Item | None = None
    fence = False
    section_level = 0  # > 0 inside a claim section
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence, current = not fence, None
            continue
        if fence:
            continue
        heading = re.match(r"^(#+)\s+(.*)", line)
        if heading:
            level = len(heading.group(1))
            if section_level and level <= section_level:
                section_level = 0
            if CLAIM_SECTION.match(heading.group(2)):
                section_level = level
            every.append((Item(doc, lineno, stripped), False, False))  # a heading ends any list
            current = None
            continue
        if not stripped:
            current = None
            continue
        is_list = bool(re.match(r"^\s*(?:[-*+]|\d+\.)\s", line))
        if current is None or is_list or stripped.startswith("|"):
            current = Item(doc, lineno)
            every.append((current, is_list, bool(section_level)))
        current.add(lineno, line)
    intro: Item | None = None  # the item before the current run of list items
    for item, is_list, in_section in every:
        if item.spans:  # (not a heading)
            item.claim_lines.update(item.line_of(m.start()) for m in TRIGGER.finditer(item.text))
        if in_section:
            item.claim_lines.add(item.line)
        if not is_list:
            intro = item
        elif intro is not None and intro.claim_lines and intro.text.endswith(":"):
            item.claim_lines.add(item.line)
    return [item for item, _, _ in every if item.claim_lines and item.spans]


def _ids(file: str, *names: str) -> tuple[str, ...]:
    return tuple(f"tests/{file}::{name}" for name in names)


_HUNG_GROUP = _ids("test_ft_hsdp.py", "test_hung_group_is_exited_by_its_watchdog_restarted_and_heals")
_SEAM = _ids("test_lightning_seam.py",
             "test__has_meta_device_parameters_or_buffers", "test__materialize_distributed_module",
             "test__optimizers_to_device", "test__METADATA_FILENAME", "test__set_sampler_epoch",
             "test__Stateful", "test__update_dataloader", "test__setup_distributed", "test__device_mesh",
             "test__save_distributed_checkpoint", "test__forward_redirection",
             "test__launcher_procs_and_kill",
             "test_set_world_ranks_is_called_before_the_launcher_with_devices_and_precision",
             "test_configure_ddp_wraps_then_registers_hooks", "test_ModelParallelStrategy_setup_steps",
             "test_LightningOptimizer_optimizer", "test__combined_loader", "test__mode", "test__iterator",
             "test__data_fetcher", "test__data_fetcher_length",
             "test__batches_that_stepped_and_optim_progress", "test__current_fx_name",
             "test__on_before_batch_transfer", "test__broadcast_sigterm_tensor", "test_subcommand_parser",
             "test__pytree_tree_leaves", "test__compiled_call_impl_and__orig_mod",
             "test__ops_OpOverload_and__schema",
             "test__current_graph_task_id", "test__get_raw_and__count_flops",
             "test_sdpa_flop_count_and_sdpa_backward_flop_count_with_grouped_query_attention",
             "test__python_dispatch_TorchDispatchMode",
             "test_Tensor__version", "test_UntypedStorage__new_with_weak_ptr",
             "test__iterator_and__shutdown_workers",
             "test__get_fsdp_state__fsdp_param_groups__unsharded_param__partial_reduce_output",
             "test__metadata_fn_and_dcp_metadata_classes", "test_numpy__reconstruct",
             "test_torchft_DiLoCo__fragments",
             "test_torchft_Manager__quorum_id_and__quorum_future", "test_atexit__run_exitfuncs")
_SEAM_GUARD = _ids("test_lightning_seam.py", "test_no_private_name_outside_the_seams")
_JSONARGPARSE_MESSAGES = _ids("test_lightning_seam.py", "test_jsonargparse_message",
                              "test_jsonargparse_message_patterns_each_have_a_case")
_PIN = _ids(
    "test_lightning_range.py", "test_imported_lightning_is_within_the_pin_and_the_oldest_is_its_lower_bound"
)
_REGISTRY_NAMES = _ids(
    "test_registry_and_errors.py", "test_names_registered_without_shadowing_and_documented"
)
#: every YAML of configs/: the ones test_configs.py runs, and the test that runs each of the others
_CONFIG_RUNS = _ids("test_configs.py", "test_config_trains_a_few_steps")  # every YAML not run elsewhere
_CONFIGS = (*_CONFIG_RUNS,
    *_ids("test_ft_hsdp.py", "test_kill_heal_and_bit_identical_groups"),  # ft_hsdp.yaml
    *_ids("test_ft_sync.py", "test_diloco_kill_during_an_outer_sync_then_live_heal",  # ft_hsdp_diloco.yaml
          "test_local_sgd_kill_between_outer_syncs"),  # ft_hsdp_local_sgd.yaml
    *_ids("test_ft_switch.py", "test_slow_link_switches_every_group_to_diloco_and_back_at_the_same_steps"),
    *_ids("test_ft_tensor_parallel.py", "test_two_tp_groups_kill_heal_and_end_identical"),  # ft_hsdp_tp.yaml
    # sac_budget.yaml
    *_ids("test_memory_budget.py", "test_config_sac_budget_fsdp2_two_ranks_meets_the_budget"),
    *_ids("test_hf_pretrained.py", "test_fsdp2_from_pretrained_in_configure_model",  # finetune_hf.yaml
          "test_fsdp2_weights_named_in_the_yaml_from_a_bf16_folder"))  # finetune_hf_yaml_weights.yaml
_LAYOUT = _ids("test_layout.py", "test_the_scan_sees_the_package", "test_dependencies_point_one_way",
               "test_nothing_in_the_package_imports_testing",
               "test_no_import_cycles", "test_the_cycle_finder_finds_a_cycle",
               "test_modules_stay_small_and_the_root_stays_short",
               "test_the_architecture_page_maps_every_module",
               "test_no_private_attribute_is_read_by_string_across_modules",
               "test_the_string_read_check_flags_the_old_mixins")
_CORRUPTIONS = _ids("test_checkpoint_integrity.py", "test_every_corruption_is_detected",
                    "test_single_file_corruption_is_detected",
                    "test_resuming_a_corrupted_checkpoint_stops_before_training")
_DISK_FULL = _ids("test_disk_full.py", "test_full_disk_gives_one_clear_error_on_every_rank",
                  "test_ft_hsdp_full_disk_is_one_clear_error_on_the_writing_group")
_DDP_TO_FSDP2 = _ids("test_checkpoint_integrity.py", "test_ddp_checkpoint_resumes_under_fsdp2")
_ATOMIC = _ids("test_checkpoint.py", "test_resume_is_exact_and_saves_are_atomic")
_ASYNC_CI = _ids("test_async_checkpoint.py",
                 "test_full_file_writer_commits_in_background_and_defers_removals",
                 "test_background_error_is_raised_at_the_next_poll_and_keeps_the_previous",
                 "test_sharded_writer_single_process",
                 "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")
_ASYNC_FULL = _ids("test_async_checkpoint.py", "test_sigkill_during_background_write_keeps_previous",
                   "test_async_resume_is_exact_other_types[fsdp2_process]",
                   "test_async_resume_is_exact_other_types[hsdp_thread]",
                   "test_ft_hsdp_group_dying_mid_write_leaves_no_half_checkpoint")
_FT_SYNC_KILL = _ids("test_ft_sync.py", "test_diloco_kill_during_an_outer_sync_then_live_heal")
_FT_SYNC_FULL = _ids(
    "test_ft_sync.py", "test_local_sgd_kill_between_outer_syncs", "test_streaming_diloco_two_fragments"
)
_TP_DDP = _ids("test_tensor_parallel.py", "test_fsdp2_2x2_hf_llama_gqa_equals_ddp",
               "test_fsdp2_2x2_hf_qwen2_equals_ddp", "test_hsdp_1x2x2_hf_llama_equals_ddp")
_TP_ERRORS = _ids("test_tensor_parallel.py", "test_degree_must_divide_the_devices_of_a_node",
                  "test_auto_reads_the_models_own_plan_prefixed_and_refuses_a_model_without_one",
                  "test_a_glob_that_matches_nothing_and_sizes_that_do_not_split_are_refused",
                  "test_plans_with_styles_this_package_does_not_apply_are_refused_by_style",
                  "test_a_glob_naming_a_parameter_says_so")
_TP_STATE = _ids("test_tensor_parallel_state.py", "test_save_under_2x2_resume_under_4x1",
                 "test_save_under_4x1_resume_under_2x2_and_save_a_full_file")
_PROCESSES = _ids("test_processes.py", "test_a_timeout_kills_the_whole_tree_even_a_worker_in_its_own_session",
                  "test_plain_subprocess_run_leaves_the_worker_behind",
                  "test_a_test_that_leaves_an_orphan_fails_and_the_orphan_is_killed",
                  "test_ctrl_c_in_the_middle_of_a_test_leaves_no_process")
_PREEMPTION = _ids("test_preemption.py",
                   "test_sigterm_to_the_launcher_stops_every_rank_checkpoints_and_resumes_exactly",
                   "test_sigterm_to_one_rank_under_torchrun_stops_both",
                   "test_options_are_checked_before_any_process_group",
                   "test_watchdog_bounds_the_stop_and_exits_with_the_requeue_status",
                   "test_ft_launcher_forwards_sigterm_to_every_group_and_exits_for_a_requeue")
_FORKSERVER = _ids("test_ft_hsdp.py", "test_forkserver_runner_restarts_preimported_groups_that_heal",
                   "test_forkserver_group_fails_as_a_whole_like_torchrun",
                   "test_forkserver_runner_rejects_warm_spares_and_another_python")
_WARM_SPARE = _ids("test_ft_hsdp.py", "test_warm_spare_replaces_a_killed_group_and_heals")
_FT_DATA = _ids("test_ft_data.py", "test_every_sample_is_accounted_for_across_kills[skip-2]",
                "test_every_sample_is_accounted_for_across_kills[skip-1]",
                "test_every_sample_is_accounted_for_across_kills[redistribute-2]")
_FT_WIDTH = _ids("test_ft_data.py", "test_a_job_resumed_with_three_groups_trains_the_rest_of_the_epoch_once",
                 "test_a_resume_at_another_width_continues_at_the_global_sample_position")
_FT_ACCUMULATION = _ids(
    "test_ft_hsdp.py", "test_accumulation_one_cross_group_reduction_per_step_sharded_gradients_kill_and_heal")
_FT_SWITCH = _ids(
    "test_ft_switch.py", "test_slow_link_switches_every_group_to_diloco_and_back_at_the_same_steps"
)
_SITE = _ids("docs/test_site.py", "test_option_discovery_follows_kwargs_into_the_parent",
             "test_page_renders_every_option_in_a_parameters_table")
_NETNS = _ids("test_netns.py", "test_hsdp_across_two_hosts_shards_within_and_replicates_across",
              "test_ft_hsdp_partition_drops_the_cut_off_group_and_heals_it")
_FSDP_SINGLE = _ids("test_fsdp_hsdp.py",
                    "test_fsdp2_two_ranks_matches_single_process_with_accumulation_and_clipping",
                    "test_hsdp_2x2_matches_single_process")
_ZYGOTE = _ids("test_zygote.py", *(f"test_a_forked_job_sees_what_a_fresh_interpreter_sees[{form}]"
                                   for form in ("script", "module", "code")),
               "test_an_import_time_variable_of_its_own_gets_a_fresh_interpreter",
               "test_what_a_job_starts_with_sys_executable_is_forked_too",
               "test_signals_reach_the_job_and_its_death_is_the_clients",
               "test_a_killed_client_takes_its_jobs_tree_with_it")

_ACCUMULATION = _ids("test_accumulation.py",
                     "test_fsdp2_accumulation_holds_only_sharded_gradients_and_equals_ddp",
                     "test_hsdp_2x2_accumulation_all_reduces_across_replicas_once_per_step_and_equals_ddp")
_TP_CONFIGS = _ids(
    "test_configs.py", "test_config_trains_a_few_steps[fsdp2_tp]", "test_config_trains_a_few_steps[hsdp_tp]"
)
_HF_FIRST_LOSS = _ids("test_hf_pretrained.py", "test_fsdp2_from_pretrained_in_configure_model",
                      "test_hsdp_2x2_gpt2_keeps_its_tie",
                      "test_ft_hsdp_two_groups_start_from_the_pretrained_weights")
_REAL_MODELS = _ids("test_real_models.py", "test_two_rank_cell", "test_hsdp_four_rank_cell",
                    "test_ft_hsdp_hf_llama_kill_and_heal", "test_a_cell_whose_reference_is_missing_fails")
_SCALAR = _ids("test_scalar_params.py",
               "test_fsdp2_two_ranks_trains_0d_params_as_ddp_with_accumulation_and_resume",
               "test_hsdp_2x2_trains_0d_params_as_ddp_and_resumes",
               "test_ft_hsdp_two_groups_keep_0d_params_identical[init_sync]",
               "test_ft_hsdp_two_groups_keep_0d_params_identical[no_init_sync]")
_RESUME = (*_ATOMIC, *_ids("test_resume.py", "test_mid_epoch_resume_equals_uninterrupted_run",
                           "test_two_ranks_resume_with_injected_distributed_sampler"))
_BUDGET = _ids("test_memory_budget.py",
               "test_budget_meets_its_targets_with_the_gradients_of_no_checkpointing",
               "test_fsdp2_two_ranks_budget_targets_and_offload_gradients")
_BUDGET_VS_FIXED = _ids(
    "test_memory_budget.py", "test_budget_recomputes_no_more_than_a_fixed_mode_keeping_as_much"
)
_BUDGET_BF16 = _ids(
    "test_memory_budget.py", "test_budget_under_bf16_autocast_has_the_gradients_of_no_checkpointing"
)
_BUDGET_CONFIG = _ids("test_memory_budget.py", "test_config_sac_budget_fsdp2_two_ranks_meets_the_budget")
_TP_BUDGET = _ids("test_tensor_parallel.py", "test_hsdp_1x2x2_hf_llama_equals_ddp")

#: make test-torch-range runs these against torch 2.11.0 (Python 3.12, transformers 5.17.0) and 2.14.1
_TORCH_RANGE = (*_ids("test_torch_range.py", "test_the_claimed_floors_are_the_tested_floors",
                      "test_requires_python_admits_exactly_the_tested_pythons",
                      "test_readme_and_the_table_state_the_tested_ends",
                      "test_this_run_is_inside_the_claims"),
                *_FSDP_SINGLE[:1], *_FORKSERVER[:1], *_TP_DDP[2:],
                *_ids("test_hf_pretrained.py", "test_worked_example_finetune_export_reload"),
                *_ASYNC_CI[3:], *_SEAM)

GUARANTEES: tuple[Guarantee, ...] = (
    # README.md
    Guarantee("README.md", "tested against the oldest release",
              (*_PIN, *_SEAM[:3], *_SEAM_GUARD, *_FSDP_SINGLE[:1],
               *_ids("test_ft_data.py", "test_every_sample_is_accounted_for_across_kills[skip-2]")),
              "the pin, its lower bound and this README line are checked; these tests are among the ones "
              "`make test-lightning-range` runs against both releases "
              "(the seam tests, and the two multi-process runs "
              "marked lightning_range). Its one-process fit per "
              "strategy (test_lightning_range.py) is skipped outside "
              "that stage, so check (b) cannot count it here."),
    Guarantee("README.md", "tested at both ends by `make test-torch-range`", _TORCH_RANGE,
              "the claims equal the Makefile's ends (test_torch_range.py); these tests are among the ones "
              "`make test-torch-range` runs against both ends (its junit XML: torch-range-*.xml)"),
    Guarantee("README.md", "modules with one test each", (*_SEAM, *_SEAM_GUARD)),
    Guarantee("README.md", "a test checks that every registered name", _REGISTRY_NAMES),
    Guarantee("README.md", "Every YAML in `configs/` runs for a few steps in the test suite", _CONFIGS),
    # docs/architecture.md
    Guarantee("docs/architecture.md", "enforced by `tests/test_layout.py`", _LAYOUT),
    Guarantee("docs/architecture.md", "`tests/test_layout.py` checks the table above", _LAYOUT),
    Guarantee("docs/architecture.md", "Each name has a test in `tests/test_lightning_seam.py`",
              (*_SEAM, *_SEAM_GUARD)),
    Guarantee("docs/architecture.md", "breaks one test with the name in it", _SEAM),
    Guarantee("docs/architecture.md", "one test per pattern against the", _JSONARGPARSE_MESSAGES),
    Guarantee("docs/architecture.md", "exercised by `tests/test_configs.py`", _CONFIG_RUNS),
    # docs/callbacks
    Guarantee("docs/callbacks/activation_checkpointing.md",
              "What the tests show (`tests/test_memory_budget.py`",
              (*_BUDGET, *_BUDGET_VS_FIXED, *_BUDGET_CONFIG, *_BUDGET_BF16)),
    Guarantee("docs/callbacks/activation_checkpointing.md",
              "On the example Llama and Hugging Face Llama and Qwen2", _BUDGET),
    Guarantee("docs/callbacks/activation_checkpointing.md", "HF ConvNeXt (tiny config, stages of widths",
              _ids(
        "test_memory_budget.py", "test_budget_profiles_each_size_of_a_block_class")),
    Guarantee("docs/callbacks/activation_checkpointing.md", "At the bytes `selective_layer` keeps",
              _BUDGET_VS_FIXED),
    Guarantee("docs/callbacks/activation_checkpointing.md",
              "`configs/sac_budget.yaml` through the example's LightningCLI", (*_BUDGET_CONFIG, *_TP_BUDGET)),
    Guarantee("docs/callbacks/activation_checkpointing.md", "Under bf16 autocast", _BUDGET_BF16),
    Guarantee("docs/callbacks/garbage_collection.md", "`tests/test_garbage_collection.py` checks both", _ids(
        "test_garbage_collection.py",
        "test_a_reported_collection_pause_is_not_a_straggler_and_the_same_pause_unreported_is")),
    # docs/checkpoints.md
    Guarantee("docs/callbacks/hang_watchdog.md",
              "`tests/test_hang_watchdog.py`, 2 real ranks (torchrun, gloo)",
              _ids("test_hang_watchdog.py",
                   "test_fsdp2_rank_asleep_in_training_step_is_named_and_every_rank_exits_81",
                   "test_hsdp_rank_stuck_in_its_data_loader_is_named_and_every_rank_exits_81")),
    Guarantee("docs/callbacks/hang_watchdog.md", "`tests/test_ft_hsdp.py`, `ft_hsdp` with the launcher",
              _HUNG_GROUP),
    Guarantee("docs/hangs.md", "(tested in `tests/test_ft_hsdp.py` with the launcher)", _HUNG_GROUP),
    Guarantee("docs/callbacks/nonfinite_guard.md", "`tests/test_nonfinite_guard.py`, 2 real ranks (gloo)",
              _ids("test_nonfinite_guard.py", "test_nan_on_one_rank_skips_the_step_on_every_rank_exactly",
                   "test_max_consecutive_stops_with_the_step_rank_and_parameter")),
    Guarantee("docs/callbacks/nonfinite_guard.md",
              "`ft_hsdp` (`tests/test_ft_hsdp.py`, the launcher, 2 groups", _ids(
        "test_ft_hsdp.py", "test_nonfinite_loss_group_leaves_the_step_and_groups_stay_identical[skip]",
        "test_nonfinite_loss_group_leaves_the_step_and_groups_stay_identical[redistribute]")),
    Guarantee("docs/gpu.md",
              "(`tests/test_async_checkpoint.py` reproduces it on a CPU with a `cuda:gloo` default group",
              _ids("test_async_checkpoint.py", "test_sharded_writer_default_group_without_cpu_backend")),
    Guarantee("docs/gpu.md", "(`tests/test_parallelize.py` checks the placement",
              _ids("test_parallelize.py",
                   "test_cpu_offload_placement_keeps_parameters_on_cpu_and_moves_buffers")),
    Guarantee("docs/checkpoints.md", "Tested with real ranks (`tests/test_resume_width.py`", _ids(
        "test_resume_width.py", "test_fsdp2_grown_shrunk_and_uneven_trains_every_sample_once",
              "test_strategy_and_mesh_changes_keep_the_position",
              "test_a_position_that_cannot_be_recomputed_is_refused[stateful-is a stateful loader (its saved "
        "state is per rank)]", "test_refuse_policy_names_both_sizes")),
    Guarantee("docs/port.md", "`tests/test_port_example.py` trains both", _ids(
        "test_port_example.py", "test_the_port_in_the_docs_trains")),
    Guarantee("docs/callbacks/mfu_monitor.md", "against what the callback logs (`tests/test_throughput.py`)",
              _ids("test_throughput.py", "test_single_device_accumulation_sac_and_sources")),
    Guarantee("docs/callbacks/mfu_monitor.md", "of a CSV logger's row (`tests/test_throughput.py`", _ids(
        "test_throughput.py", "test_single_device_accumulation_sac_and_sources")),
    Guarantee("docs/migrate.md", "`tests/test_migrate_page.py` runs it", _ids(
        "test_migrate_page.py", "test_the_migration_page_builds_what_it_names")),
    Guarantee("README.md", "with a worked diff that a test trains",
              _ids("test_port_example.py", "test_the_port_in_the_docs_trains")),
    Guarantee("docs/port.md", "checked by the test",
              _ids("test_port_example.py", "test_the_port_in_the_docs_trains")),
    Guarantee("docs/checkpoints.md", "in `tests/test_checkpoint_location.py` (`memory://`", _ids(
        "test_checkpoint_location.py",
        "test_a_url_checkpoint_dir_is_refused_before_training_or_written_there[fsdp2]",
        "test_a_url_checkpoint_dir_is_refused_before_training_or_written_there[ddp_hooks]",
        "test_export_and_verify_name_the_url", "test_a_url_pretrained_folder_is_refused_with_the_fix")),
    Guarantee("docs/checkpoints.md", "Tested against a real S3 server (SeaweedFS)", _ids(
        "test_object_store.py",
        "test_fsdp2_and_hsdp_save_to_s3_resume_exactly_and_survive_a_kill_mid_save",
        "test_a_server_lost_mid_save_fails_every_rank_and_leaves_the_previous_checkpoint",
        "test_full_file_checkpoints_are_one_object_each_and_resume_exactly[ddp_hooks-thread]",
        "test_full_file_checkpoints_are_one_object_each_and_resume_exactly[fsdp2_full-off]",
        "test_bad_urls_and_credentials_are_clear_errors_and_removal_is_best_effort",
        "test_export_writes_both_formats_to_s3_and_never_into_a_used_prefix",
        "test_a_folder_upload_puts_the_named_files_last")),
    Guarantee("docs/checkpoints.md", "`ft_hsdp` (2 groups x 2 ranks under `fsdp-strategies-ft`",
              _ids("test_ft_hsdp.py",
                   "test_every_group_down_resumes_from_the_newest_checkpoint_not_step_0[s3]")),
    Guarantee("docs/checkpoints.md", "(tested by killing a run mid-save)", _ATOMIC,
              "the test crashes a process after the shards are written and before the commit"),
    Guarantee("docs/checkpoints.md", "(`tests/test_disk_full.py`, 2 ranks, gloo)", _DISK_FULL),
    Guarantee("docs/checkpoints.md", "the tests corrupt a real 2-rank checkpoint 11 ways", _CORRUPTIONS),
    Guarantee("docs/checkpoints.md",
              "A test checks that a checkpoint carrying an `os.system` payload is refused",
              _ids("test_checkpoint_integrity.py", "test_export_and_verify_refuse_a_file_that_runs_code",
                   "test_hostile_dcp_metadata_is_never_unpickled")),
    Guarantee("docs/checkpoints.md", "Tested (tests/test_hf_export.py)", _ids(
        "test_hf_export.py", "test_round_trip_with_the_pretrained_config",
        "test_sharded_export_loads_the_same", "test_layout_and_tied_weights_are_save_pretrained_s")),
    Guarantee("docs/checkpoints.md", "continues the uninterrupted `ddp` run's losses (tested)",
              _DDP_TO_FSDP2),
    Guarantee("docs/checkpoints.md",
              "each is tested with 2 real ranks (`tests/test_async_checkpoint.py`, `test_ddp_hooks.py`, "
              "`test_ft_hsdp.py`; the SIGKILL", (
        *_ASYNC_CI, *_ASYNC_FULL, *_ids("test_ddp_hooks.py", "test_comm_hooks_train_and_match_ddp"),
        *_ids("test_ft_hsdp.py", "test_no_fault_matches_hsdp_and_checkpoint_resume_continues_exactly"))),
    Guarantee("docs/checkpoints.md", "**Atomic.**", (
        *_ids("test_async_checkpoint.py", "test_sharded_writer_single_process",
              "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact",
              "test_process_type_needs_a_sharded_checkpoint"),
        *_ASYNC_FULL[:1], *_ids("test_ddp_hooks.py", "test_comm_hooks_train_and_match_ddp"))),
    Guarantee("docs/checkpoints.md", "**`ModelCheckpoint` bookkeeping.**", _ids(
        "test_async_checkpoint.py", "test_full_file_writer_commits_in_background_and_defers_removals",
        "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")),
    Guarantee("docs/checkpoints.md", "**One write in flight.**", _ids(
        "test_async_checkpoint.py", "test_full_file_writer_commits_in_background_and_defers_removals",
        "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")),
    Guarantee("docs/checkpoints.md", "**Errors are loud.**", _ids(
        "test_async_checkpoint.py", "test_background_error_is_raised_at_the_next_poll_and_keeps_the_previous",
        "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")),
    Guarantee("docs/checkpoints.md",
              "**`fit` waits.** `on_train_end` waits for the write in flight and raises its error", _ids(
        "test_async_checkpoint.py",
        "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")),
    Guarantee("docs/checkpoints.md", "the test resumes 4 + 4 steps from an async checkpoint", _ids(
        "test_async_checkpoint.py",
        "test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact")),
    Guarantee("docs/checkpoints.md", "if it dies mid-write, no half checkpoint appears", _ASYNC_FULL[3:]),
    # docs/failure-behaviour.md
    Guarantee("docs/failure-behaviour.md", "the tested cases: [a full disk]", _DISK_FULL),
    # docs/ft-scale.md
    Guarantee("docs/ft-scale.md", "`tests/test_ft_scale.py` checks that a kept reader", _ids(
        "test_ft_scale.py", "test_the_launchers_event_readers_keep_no_records_and_look_once_per_pass")),
    # docs/getting-started.md
    Guarantee("docs/getting-started.md", "a test checks that every name this package registers",
              _REGISTRY_NAMES),
    Guarantee("docs/getting-started.md", "`tests/test_lightning_seam.py` has one test per name",
              (*_SEAM, *_SEAM_GUARD)),
    Guarantee("docs/getting-started.md", "run `pytest tests/test_lightning_seam.py`", _SEAM),
    Guarantee("docs/getting-started.md", "Every YAML in `configs/` is run for a few steps by the test suite",
              _CONFIGS),
    Guarantee("docs/getting-started.md", "shrunk to a tiny model in the tests", _ids(
        "test_configs.py", "test_config_trains_a_few_steps[fsdp2_gpu_1b]")),
    Guarantee("docs/getting-started.md", "every one with type and default (`tests/test_cli_help.py`)", _ids(
        "test_cli_help.py", "test_strategy_help_lists_every_option_with_type_and_default",
        "test_fit_help_lists_the_strategy_and_callback_options")),
    Guarantee("docs/getting-started.md",
              "same message leads a `ValueError` (`fsdp_strategies._options.OptionError`) "
              "(`tests/test_cli_errors.py`)", _ids(
                  "test_cli_errors.py",
                  *(f"test_bad_values_refused_by_the_classes_are_one_line[{case}]" for case in (
                      "gc-every-0", "budget-above-1", "budget-negative", "budget-mode-without-budget",
                      "tp-degree-0", "pretrained-missing")),
                  "test_option_errors_from_python_lead_with_the_message",
                  "test_an_option_error_raised_on_the_ranks_is_one_line")),
    # docs/multi-node.md (the "How it is tested" section)
    Guarantee("docs/multi-node.md", "On one machine (`tests/test_multinode.py`)", _ids(
        "test_multinode.py", "test_two_nodes_hsdp_auto_degrees_then_hierarchical_sgd_levels",
        "test_ft_hsdp_replica_group_spanning_two_nodes", "test_ft_hsdp_two_replica_groups_of_two_nodes_each",
        "test_slurm_hsdp_script_runs_the_local_two_agent_lines",
        "test_slurm_ft_hsdp_script_lighthouse_step_groups_and_restart")),
    Guarantee("docs/testing.md", "In CI (`.ci/run`) these are tested: the hsdp submit", (
        "tests/slurm/test_slurm.py::test_hsdp_sbatch_two_nodes_shard_groups_are_the_nodes",
        "tests/slurm/test_slurm.py::test_preempt_checkpoint_requeue_and_exact_resume[scancel_signal_term]",
        "tests/slurm/test_slurm.py::test_ft_hsdp_job_group_step_killed_restarts_and_heals")),
    Guarantee("docs/multi-node.md", "On separate hosts with their own addresses (`tests/test_netns.py`",
              _NETNS),
    Guarantee("docs/multi-node.md", "**`hsdp` across two hosts** (`tests/test_netns.py`", _NETNS[:1]),
    Guarantee("docs/multi-node.md",
              "Both groups ended at step 40 with bit-identical parameters and optimizer state. The "
              "test takes 27 s.", _NETNS[1:]),
    # docs/pretrained.md
    Guarantee("docs/pretrained.md",
              "The test suite runs the example on a tiny model (`tests/test_hf_pretrained.py`)",
              _HF_FIRST_LOSS),
    # docs/real-models.md
    Guarantee("docs/real-models.md", "covered with `meta_init: false` by `tests/test_fsdp_hsdp.py`",
              _FSDP_SINGLE),
    Guarantee("docs/real-models.md", "`make test` runs a representative cut (`tests/test_real_models.py`",
              _REAL_MODELS),
    Guarantee("docs/pretrained.md", "`error:` line without a traceback, on every rank that meets it "
              "(`tests/test_hf_pretrained.py`", _ids(
                  "test_hf_pretrained.py",
                  *(f"test_a_damaged_folder_is_named_at_construction[{case}-]" for case in (
                      "truncated", "not-safetensors", "no-config", "config-not-json", "index-missing-shard")),
                  "test_weights_of_another_size_name_the_tensors_and_the_config",
                  "test_damaged_folders_are_one_error_line_from_the_cli")),
    # docs/strategies/fsdp2.md
    Guarantee("docs/strategies/fsdp2.md",
              "init keeps its distribution with distinct shards (`tests/test_sharded_init.py`",
              _ids("test_sharded_init.py",
                   *(f"test_a_seeded_meta_model_starts_where_the_eager_one_does[{c}]"
                     for c in ("tp_colwise_rowwise", "fsdp", "replicate_x_shard")),
                   *(f"test_the_shards_of_a_weight_are_not_copies_of_each_other[{c}]"
                     for c in ("tp_colwise_rowwise", "fsdp", "hf_llama_fsdp")),
                   "test_hugging_face_init_keeps_its_distribution_on_every_shard")),
    Guarantee("docs/strategies/fsdp2.md", "plain `transformers` model holding the same weights "
              "(`tests/test_outside_calls.py`", _ids(
                  "test_outside_calls.py",
                  *(f"test_the_inner_model_called_outside_the_steps_gives_the_unsharded_"
                                             f"outputs[{s}]" for s in ("fsdp2", "hsdp", "fsdp2_tp",
                                                                       "ft_hsdp")))),
    Guarantee("docs/strategies/fsdp2.md", "gets hybrid sharding under `hsdp` (tested)", _ids(
        "test_real_models.py", "test_lightning_style_configure_model_gets_hybrid_sharding_under_hsdp")),
    Guarantee("docs/strategies/fsdp2.md", "counted in the tests", _FSDP_SINGLE,
              "the all-gathers per micro-batch are counted: the "
              "root once after the first step, 5 a step when routed"),
    Guarantee("docs/strategies/fsdp2.md",
              "with `no_sync` accumulation both are checked against a single-process run in the tests",
              _FSDP_SINGLE[:1]),
    Guarantee("docs/strategies/fsdp2.md",
              "reduce-scatter counts and `ddp`-equal losses are tested in `tests/test_accumulation.py`",
              _ACCUMULATION),
    Guarantee("docs/strategies/fsdp2.md", "Losses equal `ddp`'s step for step (`tests/test_scalar_params.py`",
              (
        *_SCALAR, *_ids("test_real_models.py", "test_two_rank_cell[hf_clip-fsdp2-none-32-true]",
                        "test_hsdp_four_rank_cell[hf_clip-hsdp-none-32-true]"))),
    # docs/strategies/hsdp.md
    Guarantee("docs/strategies/hsdp.md", "losses equal `ddp`'s (`tests/test_accumulation.py`)",
              _ACCUMULATION[1:]),
    # docs/strategies/ft_hsdp.md
    Guarantee("docs/strategies/ft_hsdp.md", "Both modes are tested with SIGKILLs", _FT_DATA),
    Guarantee("docs/strategies/ft_hsdp.md", "Tested with `accumulate_grad_batches=4`", _FT_ACCUMULATION),
    Guarantee("docs/strategies/ft_hsdp.md", "The data accounting test (`tests/test_ft_data.py`)", _FT_DATA),
    Guarantee("docs/checkpoints.md", "Tested in `tests/test_ft_data.py`: 2 groups -> 3", _FT_WIDTH),
    Guarantee("docs/strategies/ft_hsdp.md", "tested by `tests/test_ft_sync.py` and `tests/test_ft_switch.py`",
              (*_FT_SYNC_KILL, *_FT_SWITCH)),
    Guarantee("docs/strategies/ft_hsdp.md", "(tested by digests)", (*_FT_SYNC_KILL, *_FT_SYNC_FULL)),
    Guarantee("docs/strategies/ft_hsdp.md", "Tests: `tests/test_ft_sync.py`",
              (*_FT_SYNC_KILL, *_FT_SYNC_FULL)),
    Guarantee("docs/strategies/ft_hsdp.md", "Tests (`tests/test_ft_switch.py`", (
        *_FT_SWITCH, *_ids("test_ft_switch.py", "test_group_killed_in_a_diloco_phase_heals_into_it"))),
    # docs/strategies/ft_launcher.md
    Guarantee("docs/strategies/ft_launcher.md",
              "Tested in `tests/test_ft_hsdp.py::test_warm_spare_replaces_a_killed_group_and_heals`",
              _WARM_SPARE),
    Guarantee("docs/strategies/ft_launcher.md",
              "Tested in `tests/test_ft_hsdp.py` (2 groups x 2 ranks): groups killed", _FORKSERVER),
    Guarantee("docs/strategies/ft_launcher.md", "tested with a full disk under the default", _ids(
        "test_disk_full.py", "test_ft_hsdp_full_disk_is_one_clear_error_on_the_writing_group")),
    Guarantee("docs/strategies/ft_launcher.md", "`--max-restarts` in `tests/test_disk_full.py`", _ids(
        "test_disk_full.py", "test_ft_hsdp_full_disk_is_one_clear_error_on_the_writing_group")),
    Guarantee("docs/strategies/ft_launcher.md", "(`tests/test_ft_hsdp.py::test_every_group_down_resumes_from",
              (*_ids("test_ft_hsdp.py",
                     "test_every_group_down_resumes_from_the_newest_checkpoint_not_step_0[local]",
                     "test_a_group_restarted_beside_a_live_peer_heals_and_is_handed_nothing"),
               *_ids("test_multinode.py", "test_slurm_ft_hsdp_script_lighthouse_step_groups_and_restart"))),
    Guarantee("docs/strategies/ft_launcher.md", "with stub SLURM commands in `tests/test_multinode.py`)",
              _ids("test_multinode.py", "test_slurm_ft_hsdp_script_lighthouse_step_groups_and_restart")),
    Guarantee("docs/strategies/ft_launcher.md", "Checked in `tests/test_ft_protocol.py`: a", _ids(
        "test_ft_protocol.py",
        "test_torchft_started_under_the_runtime_env_logs_warnings_only_and_runs_one_thread[defaults]",
        "test_torchft_started_under_the_runtime_env_logs_warnings_only_and_runs_one_thread[user_set]",
        "test_torchft_runtime_env_fills_only_what_the_environment_leaves_unset_and_removes_it_after")),
    Guarantee("docs/strategies/ft_launcher.md", "`tests/test_preemption.py` sends SIGTERM to the launcher",
              _ids(
        "test_preemption.py",
        "test_ft_launcher_forwards_sigterm_to_every_group_and_exits_for_a_requeue[forkserver]")),
    # docs/strategies/tensor_parallel.md
    Guarantee("docs/strategies/tensor_parallel.md", "run by the test suite (`tests/test_configs.py`)",
              _TP_CONFIGS),
    Guarantee("docs/strategies/tensor_parallel.md", "`tests/test_tensor_parallel.py` tests the degree",
              _TP_ERRORS),
    Guarantee("docs/strategies/tensor_parallel.md", "`tests/test_tensor_parallel.py` runs 4 CPU processes",
              _TP_DDP),
    Guarantee("docs/strategies/tensor_parallel.md", "`Qwen2ForCausalLM` from tiny random configs", _TP_DDP),
    Guarantee("docs/strategies/tensor_parallel.md", "a Llama with its LM head tied to the embedding", _ids(
        "test_tensor_parallel.py", "test_fsdp2_2x2_tied_embeddings_stay_one_tensor_and_equal_ddp")),
    Guarantee("docs/strategies/tensor_parallel.md", "the example model with the explicit plan", _ids(
        "test_tensor_parallel.py", "test_the_example_with_an_explicit_plan_trains")),
    Guarantee("docs/strategies/tensor_parallel.md", "runs unchanged (next section)", _ids(
        "test_tensor_parallel.py",
        "test_own_plan_configure_model_runs_unchanged_like_lightning_model_parallel")),
    Guarantee("docs/strategies/tensor_parallel.md", "the bad inputs of the previous section", _TP_ERRORS),
    Guarantee("docs/strategies/tensor_parallel.md", "**Gradient clipping** works per mesh", _TP_DDP,
              "the three runs clip at 1.0 (`_run(..., clip=True)`)"),
    Guarantee("docs/strategies/tensor_parallel.md",
              "`tests/test_tensor_parallel_state.py` (2 x 2 on 4 CPU processes", _TP_STATE),
    Guarantee("docs/strategies/tensor_parallel.md", "**checkpoints across meshes**", _TP_STATE),
    Guarantee("docs/strategies/tensor_parallel.md", "**export**", _ids(
        "test_tensor_parallel_state.py", "test_export_of_a_2x2_checkpoint_loads_in_plain_transformers")),
    Guarantee("docs/strategies/tensor_parallel.md",
              "**gradient accumulation** (2) with full activation checkpointing",
              _ids("test_tensor_parallel_state.py",
                   "test_accumulation_and_full_activation_checkpointing_under_2x2_equal_ddp",
                   "test_bf16_selective_activation_checkpointing_and_compiled_blocks_under_2x2")),
    Guarantee("docs/strategies/tensor_parallel.md", "**`MFUMonitor`**", _ids(
        "test_tensor_parallel_state.py", "test_mfu_counts_what_each_device_does")),
    Guarantee("docs/strategies/tensor_parallel.md", "`tests/test_ft_tensor_parallel.py`: `ft_hsdp`", _ids(
        "test_ft_tensor_parallel.py", "test_two_tp_groups_kill_heal_and_end_identical")),
    Guarantee("docs/strategies/tensor_parallel.md",
              "`tests/test_tensor_parallel.py` runs one under Lightning's", _ids(
        "test_tensor_parallel.py",
        "test_own_plan_configure_model_runs_unchanged_like_lightning_model_parallel")),
    # docs/testing.md
    Guarantee("docs/testing.md", "Distributed tests start real processes", _FSDP_SINGLE),
    Guarantee("docs/testing.md", "parameters after N steps of `fsdp2`", _FSDP_SINGLE),
    Guarantee("docs/testing.md",
              "gradient accumulation (4 micro-batches) under `fsdp2` (2 ranks) and `hsdp` (2x2): after every",
              _ACCUMULATION),
    Guarantee("docs/testing.md", "once per FSDP unit per optimizer step (`tests/test_accumulation.py`)",
              _ACCUMULATION),
    Guarantee("docs/testing.md", "resume is exact (4 steps + save + resume + 4 steps == 8 steps", _RESUME),
    Guarantee("docs/testing.md", "a 2-rank `ddp` checkpoint resumed under 2-rank `fsdp2`", _DDP_TO_FSDP2),
    Guarantee("docs/testing.md", "11 corruptions of a real sharded checkpoint", _CORRUPTIONS),
    Guarantee("docs/testing.md", "refused without running it (`tests/test_checkpoint_integrity.py`)", _ids(
        "test_checkpoint_integrity.py", "test_export_and_verify_refuse_a_file_that_runs_code")),
    Guarantee("docs/testing.md", "every YAML in `configs/` runs for a few steps", (*_CONFIGS, *_REAL_MODELS)),
    Guarantee("docs/testing.md", "after every test `tests/conftest.py` fails the test", _PROCESSES[2:3]),
    Guarantee("docs/testing.md", "is forked from a *zygote*", _ZYGOTE),
    Guarantee("docs/testing.md", "`tests/test_zygote.py` runs the same probe both ways", _ZYGOTE),
    Guarantee("docs/testing.md", "What it cannot give a job is its client's pid", _ids(
        "test_ft_scale.py", "test_quick_sweep_reaches_quorum_drops_the_killed_group_and_heals_it")),
    Guarantee("docs/testing.md",
              "`tests/test_processes.py` checks all of it with a worker that moves to its own session: "
              "a timeout kills it, plain `subprocess.run` would have "
              "left it, a test that orphans it fails, and Ctrl-C "
              "in the middle of a test leaves nothing running", _PROCESSES),
    Guarantee("docs/testing.md",
              "Markers say what a test starts, and every selection by marker relies on them: "
              "`multiprocess` (a distributed job: several ranks or "
              "replica groups), `subprocess` (one child process), "
              "`slurm` (jobs on the SLURM test cluster). `tests/support/processes.py` calls a check before "
              "every start, and a "
              "test that starts a process without one of these "
              "markers fails with the fix (`tests/test_processes.py` "
              "shows it)",
              _ids("test_processes.py", "test_a_test_that_starts_a_process_without_a_marker_fails")),
    Guarantee("docs/testing.md", "CI: `tests/test_preemption.py`", _PREEMPTION),
    Guarantee("docs/testing.md", "CI: `tests/test_clean_exit.py`", _ids("test_clean_exit.py",
                                                                         "test_back_to_back_gloo_jobs_exit_zero")),
    Guarantee("docs/testing.md",
              "`pytest tests/test_async_checkpoint.py` (CI: `make test` and `make test-full`)",
              (*_ASYNC_CI, *_ASYNC_FULL)),
    Guarantee("docs/testing.md", "`ft_hsdp`'s data under faults (`tests/test_ft_data.py`), sync modes "
              "(`tests/test_ft_sync.py`), the straggler switch "
              "(`tests/test_ft_switch.py`), warm spares and the "
              "forkserver runner (`tests/test_ft_hsdp.py`)", (
        *_FT_DATA, *_FT_SYNC_KILL, *_FT_SYNC_FULL, *_FT_SWITCH, *_WARM_SPARE, *_FORKSERVER)),
    Guarantee("docs/testing.md", "then runs `tests/docs/test_site.py`", _SITE),
    Guarantee("docs/testing.md",
              "`tests/guarantees.py` registers each sentence of `README.md` and `docs/` that says a "
              "behaviour is tested (the patterns are its `TRIGGER`, "
              "plus every item of a \"How it is tested\" / \"What "
              "is tested\" section)", _ids("test_guarantees.py", "test_the_scanner_finds_each_kind_of_claim",
                                           "test_every_claim_in_the_docs_is_registered")),
    Guarantee("docs/testing.md",
              "`tests/test_guarantees.py`, in `make test`, fails on a claim that is not registered, a "
              "registered phrase no longer in its page, a test file the sentence names", _ids(
                  "test_guarantees.py", "test_every_claim_in_the_docs_is_registered",
                  "test_unregistered_can_fail",
                  "test_no_registered_phrase_is_stale", "test_a_test_file_a_claim_names_is_among_its_tests",
                  "test_files_not_covered_can_fail",
                  "test_every_registered_test_is_collected_and_selected_by_ci",
                  "test_not_run_by_ci_can_fail", "test_junit_outcomes_and_not_passed_can_fail")),
)

NOT_CLAIMS: tuple[NotAClaim, ...] = (
    NotAClaim("README.md", "what the tests check", "a link to docs/testing.md in the docs table"),
    NotAClaim("docs/getting-started.md", "| package | range (`pyproject.toml`) | tested |",
              "the header of the versions table: the versions CI installs (Makefile), not a behaviour"),
    NotAClaim("docs/multi-node.md", "It needs root; the tests skip with the reason elsewhere",
              "what the network-namespace tests need (CI must run as root for them to pass, not skip)"),
    NotAClaim("docs/multi-node.md", "the test restarts a group that exits",
              "describes the FSDP_STRATEGIES_FULL-only long-partition "
              "run (test_netns.py::test_ft_hsdp_long_partition, "
              "not in CI) and what it observed; its CI form, the 8 s partition, is registered above"),
    NotAClaim("docs/multi-node.md", "(65 s for the test)",
              "the same FSDP_STRATEGIES_FULL-only run's restart budget"),
    NotAClaim("docs/multi-node.md", "(20 in the tests)",
              "the value the tests use, not a claim that something is tested"),
    NotAClaim("docs/testing.md", "the test needs the built site and Chromium",
              "why `make test` leaves tests/docs out"),
    NotAClaim("docs/strategies/ft_hsdp.md", "-k \"chaos or kill or streaming\" -s`: 5 passed",
              "the command of a run measured once (the chaos runs "
              "are soak variants, not CI); the CI tests of the "
              "same paragraph are registered under 'Tests: `tests/test_ft_sync.py`'"),
    NotAClaim("docs/strategies/tensor_parallel.md", "Not tested: `data_on_failure: redistribute`",
              "an item of the 'What is tested' section that says what is not tested"),
)
