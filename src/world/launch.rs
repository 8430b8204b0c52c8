//! What a launcher tells a process through its environment, read without MPI: whether
//! `mpirun` or `srun` started it as one of several processes, which one it is, how many
//! of them share its machine, and so how many cores it may take.
//!
//! Owns the environment variables of the launchers lockstep knows and nothing else; the
//! world itself (MPI's answer to the same questions) is `world::mpi`'s. Read first, so
//! that a binary built without MPI refuses to train as one of P silent copies.

use std::fmt;

/// The launcher a process was started by, as its environment says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Which launcher: "Open MPI", "MPICH/PMI", "PMIx", "Slurm".
    pub launcher: &'static str,
    /// This process's index and the number of processes.
    pub process: usize,
    pub size: usize,
    /// Processes of the job on this machine (1 when the launcher does not say).
    pub local_size: usize,
    /// The variable the size was read from.
    pub variable: &'static str,
}

impl fmt::Display for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "process {} of {}, launched by {} ({}={})",
            self.process, self.size, self.launcher, self.variable, self.size
        )
    }
}

/// The launch the environment `var` describes (`var` is `std::env::var` in a real
/// process), or `None` for a process nobody launched as part of a job. Open MPI
/// (`OMPI_COMM_WORLD_*`), MPICH, Intel MPI and other PMI launchers (`PMI_SIZE`,
/// `PMI_RANK`), PMIx (`PMIX_RANK` with `PMIX_SIZE`), and Slurm's `srun`
/// (`SLURM_STEP_NUM_TASKS`, `SLURM_PROCID`: a job step, not the batch script, whose
/// `SLURM_NTASKS` is the allocation's and says nothing about this process).
pub fn detect_with(var: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    let num = |name: &str| var(name).and_then(|v| v.trim().parse::<usize>().ok());
    let kinds: [(&'static str, &'static str, &'static str, Option<&'static str>); 4] = [
        ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", Some("OMPI_COMM_WORLD_LOCAL_SIZE")),
        ("MPICH/PMI", "PMI_SIZE", "PMI_RANK", Some("MPI_LOCALNRANKS")),
        ("PMIx", "PMIX_SIZE", "PMIX_RANK", None),
        ("Slurm", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", Some("SLURM_STEP_TASKS_PER_NODE")),
    ];
    kinds.into_iter().find_map(|(launcher, size_var, process_var, local_var)| {
        let size = num(size_var)?;
        let local_size = local_var.and_then(|v| leading_number(&var(v)?)).unwrap_or(1).max(1);
        Some(Launch { launcher, process: num(process_var).unwrap_or(0), size, local_size, variable: size_var })
    })
}

/// `4` of Slurm's `4(x2)` or `4,3`; the number itself elsewhere.
fn leading_number(v: &str) -> Option<usize> {
    let digits: String = v.trim().chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// This process's launch ([`detect_with`] over the real environment).
pub fn detect() -> Option<Launch> {
    detect_with(|name| std::env::var(name).ok())
}

/// Cores this process may use: the CPUs its affinity mask (and cgroup quota) allows; and
/// where that is the whole machine while the launcher started several processes on it
/// (Open MPI leaves an oversubscribed job unbound), the machine's share of one of them —
/// so that processes sharing a machine do not each spin a thread per core.
pub fn cores_for_this_process() -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    match detect() {
        Some(l) if l.local_size > 1 && online_cpus().is_some_and(|online| allowed >= online) => {
            (allowed / l.local_size).max(1)
        }
        _ => allowed,
    }
}

/// CPUs the kernel has online (`/sys/devices/system/cpu/online`, e.g. `0-1` or
/// `0-3,8-11`), or `None` where that file is not there.
fn online_cpus() -> Option<usize> {
    parse_cpu_list(&std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?)
}

fn parse_cpu_list(text: &str) -> Option<usize> {
    let mut n = 0;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().ok()?.checked_sub(a.parse::<usize>().ok()?)? + 1,
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() {
        assert_eq!(detect_with(env(&[])), None);
        let ompi = detect_with(env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!((ompi.launcher, ompi.process, ompi.size, ompi.local_size), ("Open MPI", 3, 4, 2));
        assert_eq!(ompi.to_string(), "process 3 of 4, launched by Open MPI (OMPI_COMM_WORLD_SIZE=4)");
        let pmi = detect_with(env(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")])).unwrap();
        assert_eq!((pmi.launcher, pmi.process, pmi.size, pmi.local_size), ("MPICH/PMI", 1, 2, 1));
        let slurm = detect_with(env(&[
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
        ]))
        .unwrap();
        assert_eq!((slurm.launcher, slurm.process, slurm.size, slurm.local_size), ("Slurm", 5, 8, 4));
        // A batch script's allocation is not a launch of this process.
        assert_eq!(detect_with(env(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0")])), None);
    }

    #[test]
    fn cpu_lists_count_every_range() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,8-11"), Some(8));
        assert_eq!(parse_cpu_list("0,2,4"), Some(3));
        assert_eq!(parse_cpu_list("x"), None);
    }
}
