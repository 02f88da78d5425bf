//! A worker's compute context, owned for one incarnation.
//!
//! DESIGN: "each GPU actor owns a CUDA context". The context (and the streams and device
//! memory made in it) lives exactly as long as the worker actor's incarnation: opened in the
//! actor's start, drained and dropped in its stop, so a `duet kill` of a GPU worker tears the
//! context down and the supervisor's restart builds a fresh one. Nothing of an old incarnation
//! can still be computing, or still hold device memory, when the next one starts.
//!
//! [`ComputeContext`] is what the worker needs of a context; [`Incarnation`] is the worker's
//! handle, whose close is drain-then-drop. The CPU has a trivial context; CUDA's is
//! `cuda::CudaContextHandle` (a primary context, a compute stream and a copy stream).

use crate::device::{Device, DeviceError};

/// What a worker needs of the context it computes in.
pub trait ComputeContext: Send {
    /// The device this context computes on.
    fn device(&self) -> Device;

    /// Waits until all work queued in this context (every stream) has finished. After it, no
    /// kernel or copy of this context is still reading or writing memory.
    fn drain(&mut self) -> Result<(), DeviceError>;

    /// Device memory in use on the context's device, in bytes (total minus free), to prove a
    /// restart leaks nothing; `None` where the device does not say (the CPU).
    fn memory_in_use(&self) -> Result<Option<usize>, DeviceError>;
}

/// Opens contexts; the real one opens devices, a test's opens doubles.
pub trait ContextFactory {
    /// The context it opens.
    type Context: ComputeContext;

    /// Opens a context on `device`, or says why it cannot.
    fn open(&self, device: Device) -> Result<Self::Context, DeviceError>;
}

/// A worker's context for one incarnation. Close it (drain, then drop) in the actor's stop;
/// dropping it unclosed (a panicking actor) still drains first, best effort.
pub struct Incarnation<C: ComputeContext> {
    ctx: Option<C>,
    device: Device,
}

impl<C: ComputeContext> Incarnation<C> {
    /// Opens the context this incarnation owns.
    pub fn open<F: ContextFactory<Context = C>>(
        factory: &F,
        device: Device,
    ) -> Result<Incarnation<C>, DeviceError> {
        let ctx = factory.open(device)?;
        Ok(Incarnation {
            ctx: Some(ctx),
            device,
        })
    }

    /// The device of this incarnation.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The open context; `None` once closed.
    pub fn context(&mut self) -> Option<&mut C> {
        self.ctx.as_mut()
    }

    /// Whether the context is still open.
    pub fn is_open(&self) -> bool {
        self.ctx.is_some()
    }

    /// Drains every stream, then drops the context (and with it what was allocated in it).
    /// The context is dropped even when the drain fails: a context whose work cannot finish is
    /// broken, and destroying it is how the driver stops that work. Closing twice is a no-op.
    pub fn close(&mut self) -> Result<(), DeviceError> {
        let Some(mut ctx) = self.ctx.take() else {
            return Ok(());
        };
        let drained = ctx.drain();
        drop(ctx);
        drained
    }
}

impl<C: ComputeContext> Drop for Incarnation<C> {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(device = %self.device, error = %e, "context dropped after a failed drain");
        }
    }
}

impl<C: ComputeContext> std::fmt::Debug for Incarnation<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incarnation")
            .field("device", &self.device)
            .field("open", &self.ctx.is_some())
            .finish()
    }
}

/// The CPU's context: nothing to create, nothing queued.
#[derive(Debug, Default)]
pub struct CpuContext;

impl ComputeContext for CpuContext {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn drain(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn memory_in_use(&self) -> Result<Option<usize>, DeviceError> {
        Ok(None)
    }
}

/// A context on any device this build knows, behind one type so the worker actors hold one
/// thing whatever their device.
pub enum AnyContext {
    /// The CPU.
    Cpu(CpuContext),
    /// A CUDA device.
    Cuda(crate::cuda::CudaContextHandle),
}

impl ComputeContext for AnyContext {
    fn device(&self) -> Device {
        match self {
            AnyContext::Cpu(c) => c.device(),
            AnyContext::Cuda(c) => c.device(),
        }
    }

    fn drain(&mut self) -> Result<(), DeviceError> {
        match self {
            AnyContext::Cpu(c) => c.drain(),
            AnyContext::Cuda(c) => c.drain(),
        }
    }

    fn memory_in_use(&self) -> Result<Option<usize>, DeviceError> {
        match self {
            AnyContext::Cpu(c) => c.memory_in_use(),
            AnyContext::Cuda(c) => c.memory_in_use(),
        }
    }
}

/// Opens real contexts: the CPU's, or a CUDA device's (after probing the driver library, so a
/// machine without CUDA gets an error, never a panic).
#[derive(Debug, Default, Clone, Copy)]
pub struct Devices;

impl ContextFactory for Devices {
    type Context = AnyContext;

    fn open(&self, device: Device) -> Result<AnyContext, DeviceError> {
        match device {
            Device::Cpu => Ok(AnyContext::Cpu(CpuContext)),
            Device::Cuda(ordinal) => {
                crate::cuda::CudaContextHandle::open(ordinal).map(AnyContext::Cuda)
            }
        }
    }
}

/// The context a worker owns for one incarnation, on whatever device it was given.
pub type WorkerContext = Incarnation<AnyContext>;

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A context that records what happens to it, and holds "device memory" while open.
    struct Double {
        log: Arc<Mutex<Vec<String>>>,
        in_use: Arc<Mutex<usize>>,
        held: usize,
        fail_drain: bool,
        id: usize,
    }

    impl ComputeContext for Double {
        fn device(&self) -> Device {
            Device::Cuda(0)
        }
        fn drain(&mut self) -> Result<(), DeviceError> {
            self.log
                .lock()
                .expect("log")
                .push(format!("drain {}", self.id));
            if self.fail_drain {
                return Err(DeviceError::Driver("illegal address".into()));
            }
            Ok(())
        }
        fn memory_in_use(&self) -> Result<Option<usize>, DeviceError> {
            Ok(Some(*self.in_use.lock().expect("mem")))
        }
    }

    impl Drop for Double {
        fn drop(&mut self) {
            self.log
                .lock()
                .expect("log")
                .push(format!("drop {}", self.id));
            *self.in_use.lock().expect("mem") -= self.held;
        }
    }

    struct Factory {
        log: Arc<Mutex<Vec<String>>>,
        in_use: Arc<Mutex<usize>>,
        opened: Mutex<usize>,
        fail_drain: bool,
    }

    impl Factory {
        fn new() -> Factory {
            Factory {
                log: Arc::default(),
                in_use: Arc::new(Mutex::new(1000)),
                opened: Mutex::new(0),
                fail_drain: false,
            }
        }
        fn log(&self) -> Vec<String> {
            self.log.lock().expect("log").clone()
        }
    }

    impl ContextFactory for Factory {
        type Context = Double;
        fn open(&self, device: Device) -> Result<Double, DeviceError> {
            if device == Device::Cpu {
                return Err(DeviceError::Driver("the double opens CUDA only".into()));
            }
            let mut n = self.opened.lock().expect("opened");
            *n += 1;
            self.log.lock().expect("log").push(format!("open {n}"));
            *self.in_use.lock().expect("mem") += 512;
            Ok(Double {
                log: self.log.clone(),
                in_use: self.in_use.clone(),
                held: 512,
                fail_drain: self.fail_drain,
                id: *n,
            })
        }
    }

    #[test]
    fn a_restart_drains_and_drops_the_old_context_before_the_new_one_opens() {
        let f = Factory::new();
        let mut first = Incarnation::open(&f, Device::Cuda(0)).expect("open");
        assert_eq!(
            first
                .context()
                .and_then(|c| c.memory_in_use().ok().flatten()),
            Some(1512)
        );
        // The actor's stop closes it; the supervisor's restart opens the next.
        first.close().expect("close");
        assert!(!first.is_open());
        let mut second = Incarnation::open(&f, Device::Cuda(0)).expect("reopen");
        assert_eq!(f.log(), ["open 1", "drain 1", "drop 1", "open 2"]);
        // Memory in use is back to its level before plus the live incarnation's.
        assert_eq!(
            second
                .context()
                .and_then(|c| c.memory_in_use().ok().flatten()),
            Some(1512)
        );
        drop(second);
        assert_eq!(
            *f.in_use.lock().expect("mem"),
            1000,
            "a closed context holds nothing"
        );
        assert_eq!(f.log().last().map(String::as_str), Some("drop 2"));
        // Closing twice (stop, then drop) drains once.
        first.close().expect("second close");
        assert_eq!(
            f.log().iter().filter(|l| l.starts_with("drain 1")).count(),
            1
        );
    }

    #[test]
    fn a_failed_drain_still_drops_the_context_and_reports_why() {
        let mut f = Factory::new();
        f.fail_drain = true;
        let mut inc = Incarnation::open(&f, Device::Cuda(0)).expect("open");
        let e = inc.close().expect_err("drain failed");
        assert!(e.to_string().contains("illegal address"), "{e}");
        assert!(!inc.is_open());
        assert_eq!(f.log(), ["open 1", "drain 1", "drop 1"]);
        assert_eq!(*f.in_use.lock().expect("mem"), 1000);
    }

    #[test]
    fn an_incarnation_dropped_without_close_drains_first() {
        let f = Factory::new();
        drop(Incarnation::open(&f, Device::Cuda(0)).expect("open"));
        assert_eq!(f.log(), ["open 1", "drain 1", "drop 1"]);
    }

    #[test]
    fn a_context_that_cannot_open_is_an_error_and_nothing_is_held() {
        let f = Factory::new();
        let e = Incarnation::open(&f, Device::Cpu).expect_err("double refuses the CPU");
        assert!(e.to_string().contains("CUDA only"), "{e}");
        assert!(f.log().is_empty());
    }

    #[test]
    fn the_real_factory_opens_the_cpu_and_refuses_cuda_without_panicking() {
        let mut cpu = Incarnation::open(&Devices, Device::Cpu).expect("cpu");
        assert_eq!(cpu.device(), Device::Cpu);
        assert_eq!(
            cpu.context().map(|c| c.memory_in_use().ok().flatten()),
            Some(None)
        );
        cpu.close().expect("close");
        // No driver here (an error), or a driver (then a real context or a real error): never
        // a panic.
        let _ = Incarnation::open(&Devices, Device::Cuda(0));
    }
}
