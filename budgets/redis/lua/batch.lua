-- batch.lua: several acquire and release operations in one call, executed in order, exactly as
-- if each had been its own script call at the same instant. Concurrent requests of one replica
-- are coalesced into one batch: one round trip, one script start, warm per-call caches.
-- A: (name, n, n arguments)* with name 'acquire' or 'release'
-- Reply: the list of the operations' replies, in order
local function batch_main(A)
  local out = {}
  local i = 1
  while i <= #A do
    local name, n = A[i], tonumber(A[i + 1])
    local args = { unpack(A, i + 2, i + 1 + n) } -- (sized at once, not grown one by one)
    i = i + 2 + n
    if name == 'acquire' then
      out[#out + 1] = acquire_main(args)
    else
      out[#out + 1] = release_main(args)
    end
  end
  return out
end
