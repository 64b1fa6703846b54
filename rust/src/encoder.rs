//! Command encoding: ops record dispatches; `commit_and_wait` runs them on the device.

use crate::buffer::MlxBuffer;
use crate::device::MlxDevice;
use crate::error::{MlxError, Result};
use crate::interface::Pipeline;
pub use crate::interface::{BoundArg, Dispatch, GridSize, RunOptions};

/// One argument of a dispatch, by reference, as the op passes it.
#[derive(Debug, Clone, Copy)]
pub enum KernelArg<'a> {
    Buffer(&'a MlxBuffer),
    /// A buffer starting `offset` bytes into it.
    BufferWithOffset(&'a MlxBuffer, u64),
    /// A small constant block (a params struct), copied at encode time.
    Bytes(&'a [u8]),
}

/// The bytes of a plain-old-data value.
pub fn as_bytes<T: bytemuck::Pod>(value: &T) -> &[u8] {
    bytemuck::bytes_of(value)
}

impl MlxDevice {
    /// A new command encoder on this device.
    pub fn command_encoder(&self) -> CommandEncoder {
        CommandEncoder::new(self.clone())
    }
}

/// Records dispatches for one device and runs them on commit.
pub struct CommandEncoder {
    device: MlxDevice,
    pending: Vec<Dispatch>,
    /// The run options stamped on each dispatch recorded from now on.
    options: RunOptions,
}

impl CommandEncoder {
    pub fn new(device: MlxDevice) -> Self {
        CommandEncoder { device, pending: Vec::new(), options: RunOptions::default() }
    }

    /// The run options the next dispatches carry.
    pub fn options(&self) -> RunOptions {
        self.options
    }

    /// Record the next dispatches with `options` (a plan's; the default: the library's
    /// choices). Those already recorded keep theirs.
    pub fn set_options(&mut self, options: RunOptions) {
        self.options = options;
    }

    pub fn device(&self) -> &MlxDevice {
        &self.device
    }

    /// Dispatches recorded and not yet committed.
    pub fn pending(&self) -> &[Dispatch] {
        &self.pending
    }

    /// Record one dispatch of `grid` threadgroups of `threadgroup` threads.
    ///
    /// Unlike the Metal encoder this returns a `Result`: a buffer of another device, or an
    /// offset past a buffer's end, is refused here, before anything runs.
    pub fn encode_threadgroups_with_args_and_shared(
        &mut self,
        pipeline: &Pipeline,
        args: &[(u64, KernelArg<'_>)],
        shared: &[(u64, u64)],
        grid: GridSize,
        threadgroup: GridSize,
    ) -> Result<()> {
        let mut bound = Vec::with_capacity(args.len());
        for (index, arg) in args {
            let arg = match *arg {
                KernelArg::Buffer(b) => BoundArg::Buffer(self.own(b, 0)?.binding()),
                KernelArg::BufferWithOffset(b, off) => BoundArg::Buffer(self.own(b, off)?.binding()),
                KernelArg::Bytes(bytes) => BoundArg::Bytes(bytes.to_vec()),
            };
            bound.push((*index, arg));
        }
        self.pending.push(Dispatch {
            pipeline: pipeline.clone(),
            args: bound,
            shared: shared.to_vec(),
            grid,
            threadgroup,
            options: self.options,
        });
        Ok(())
    }

    fn own(&self, b: &MlxBuffer, offset: u64) -> Result<MlxBuffer> {
        if b.device_id() != self.device.registry_id() {
            return Err(MlxError::InvalidArgument(format!(
                "a buffer of device {} was passed to an encoder of device {}",
                b.device_id(),
                self.device.registry_id()
            )));
        }
        if offset == 0 {
            return Ok(b.clone());
        }
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        if off > b.data_byte_len() {
            return Err(MlxError::InvalidArgument(format!(
                "offset {offset} is past the end of a {}-byte buffer",
                b.data_byte_len()
            )));
        }
        b.view(off, b.data_byte_len() - off, b.dtype(), Vec::new())
    }

    /// Run every recorded dispatch in order and wait for them. The encoder is empty
    /// afterwards, whether or not they succeeded.
    pub fn commit_and_wait(&mut self) -> Result<()> {
        let work = std::mem::take(&mut self.pending);
        if work.is_empty() {
            return Ok(());
        }
        self.device.backend().execute(&work)
    }

    /// Run every recorded dispatch in order on the caller's stream (a CUDA stream handle)
    /// without waiting for them (the CUDA backend); backends without streams run them now.
    /// The encoder is empty afterwards, whether or not they succeeded.
    pub fn commit_on_stream(&mut self, stream: u64) -> Result<()> {
        let work = std::mem::take(&mut self.pending);
        if work.is_empty() {
            return Ok(());
        }
        self.device.backend().execute_on(&work, stream)
    }

    /// Drop every recorded dispatch without running it.
    pub fn discard(&mut self) {
        self.pending.clear();
    }
}
