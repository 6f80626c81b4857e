// Every driver call the fake serves, declared for the table of entry points in
// fake_libcuda.cpp (and for the few calls between files), grouped by the file that defines it.

#pragma once

#include "fake_state.hpp"

#include <cuda.h>

#include <cstddef>

namespace [[gnu::visibility("hidden")]] fake_cuda {

// fake_device.cpp
CUresult fake_cuInit(unsigned flags);
CUresult fake_cuDriverGetVersion(int* v);
CUresult fake_cuDeviceGetCount(int* n);
CUresult fake_cuDeviceGet(CUdevice* d, int ordinal);
CUresult fake_cuDeviceGetName(char* name, int len, CUdevice d);
CUresult fake_cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d);
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d);
CUresult fake_cuCtxGetCurrent(CUcontext* c);
CUresult fake_cuCtxSetCurrent(CUcontext c);
CUresult fake_cuCtxGetDevice(CUdevice* d);
CUresult fake_cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer);
CUresult fake_cuGetErrorName(CUresult r, const char** s);
CUresult fake_cuGetErrorString(CUresult r, const char** s);

// fake_memory.cpp
CUresult fake_cuMemGetInfo(std::size_t* free, std::size_t* total);
CUresult fake_cuMemGetAllocationGranularity(std::size_t* g, const CUmemAllocationProp* p,
                                            CUmemAllocationGranularity_flags);
CUresult fake_cuMemAddressReserve(CUdeviceptr* p, std::size_t size, std::size_t alignment,
                                  CUdeviceptr hint, unsigned long long flags);
CUresult fake_cuMemAddressFree(CUdeviceptr p, std::size_t size);
CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t size,
                          const CUmemAllocationProp* p, unsigned long long flags);
CUresult fake_cuMemRelease(CUmemGenericAllocationHandle h);
CUresult fake_cuMemMap(CUdeviceptr p, std::size_t size, std::size_t offset,
                       CUmemGenericAllocationHandle h, unsigned long long flags);
CUresult fake_cuMemUnmap(CUdeviceptr p, std::size_t size);
CUresult fake_cuMemSetAccess(CUdeviceptr p, std::size_t size, const CUmemAccessDesc* d, std::size_t n);
CUresult fake_cuMemGetAccess(unsigned long long* flags, const CUmemLocation* l, CUdeviceptr p);
CUresult fake_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* p, CUmemGenericAllocationHandle h);
CUresult fake_cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                           CUmemAllocationHandleType type, unsigned long long);
CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                             CUmemAllocationHandleType type);

// fake_streams.cpp
CUresult fake_cuCtxPushCurrent(CUcontext c);
CUresult fake_cuCtxPopCurrent(CUcontext* c);
CUresult fake_cuCtxSynchronize();
CUresult fake_cuStreamCreateWithPriority(CUstream* s, unsigned flags, int);
CUresult fake_cuStreamDestroy(CUstream s);
CUresult fake_cuStreamGetId(CUstream s, unsigned long long* id);
CUresult fake_cuStreamGetCtx(CUstream s, CUcontext* c);
CUresult fake_cuStreamSynchronize(CUstream s);
CUresult fake_cuStreamQuery(CUstream s);
CUresult fake_cuEventCreate(CUevent* e, unsigned);
CUresult fake_cuEventDestroy(CUevent e);
CUresult fake_cuEventRecord(CUevent e, CUstream s);
CUresult fake_cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags);
CUresult fake_cuEventQuery(CUevent e);
CUresult fake_cuEventSynchronize(CUevent e);

// fake_capture.cpp
CUresult fake_cuStreamBeginCapture(CUstream s, CUstreamCaptureMode mode);
CUresult fake_cuStreamEndCapture(CUstream s, CUgraph* graph_out);
CUresult fake_cuStreamGetCaptureInfo(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id,
                                     CUgraph* graph, const CUgraphNode** dependencies,
                                     const CUgraphEdgeData** edge_data, std::size_t* dependency_count);
CUresult fake_cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status);
CUresult fake_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode);

// fake_graphs.cpp
CUresult fake_cuGraphDestroy(CUgraph graph);
CUresult fake_cuGraphClone(CUgraph* clone_out, CUgraph original);
CUresult fake_cuGraphCreate(CUgraph* out, unsigned flags);
CUresult fake_cuGraphAddEmptyNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, std::size_t n);
CUresult fake_cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* edges, std::size_t* n);
CUresult fake_cuGraphInstantiateWithFlags(CUgraphExec* exec_out, CUgraph graph, unsigned long long flags);
CUresult fake_cuGraphExecDestroy(CUgraphExec exec);
CUresult fake_cuGraphLaunch(CUgraphExec exec, CUstream s);
CUresult fake_cuGraphUpload(CUgraphExec exec, CUstream s);
CUresult fake_cuUserObjectCreate(CUuserObject* out, void* ptr, CUhostFn destroy, unsigned initial_refcount,
                                 unsigned flags);
CUresult fake_cuUserObjectRetain(CUuserObject obj, unsigned count);
CUresult fake_cuUserObjectRelease(CUuserObject obj, unsigned count);
CUresult fake_cuGraphRetainUserObject(CUgraph graph, CUuserObject obj, unsigned count, unsigned flags);
CUresult fake_cuGraphReleaseUserObject(CUgraph graph, CUuserObject obj, unsigned count);

}  // namespace fake_cuda
